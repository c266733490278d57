"""The fault-injection seam (ucm.adapters.faults) on a real nvme device and
a real adapter: what it injects is what the adapter reports."""
import errno
import os

import pytest

from ucm import _native
from ucm.adapters.base import Status
from ucm.adapters.dram import DramAdapter, DramConfig
from ucm.adapters.faults import FaultyAdapter, FaultyDevice
from ucm.adapters.nvme import NvmeAdapter, NvmeConfig
from ucm.errors import ArgumentError

RS = 256 << 10


def nvme(tmp_path, device):
    return NvmeAdapter(8 * RS, NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS, write_buffers=1),
                       device=device)


def two_blocks(a):
    """Two stored blocks of 50,000 random bytes (not whole pages), flushed to the medium."""
    (k1, b1), (k2, b2) = [(os.urandom(16), os.urandom(50_000)) for _ in range(2)]
    assert a.put([k1, k2], [b1, b2]) == [Status.OK] * 2
    assert a.flush()
    return (k1, b1), (k2, b2)


def test_a_corrupted_read_is_caught_by_the_checksum_and_a_failed_one_is_failed(tmp_path):
    dev = FaultyDevice(_native.IoEngine(1))
    a = nvme(tmp_path, dev)
    try:
        (k1, b1), (k2, b2) = two_blocks(a)
        out = bytearray(len(b1))
        dev.corrupt_reads(times=1)
        assert a.get([k1], [out]) == [Status.CORRUPT]  # bit rot never comes back as a hit
        assert a.get([k1], [out]) == [Status.NOT_FOUND]  # and the bad block is gone
        dev.fail_reads(errno.EIO, times=1)
        assert a.get([k2], [out]) == [Status.FAILED]
        assert a.get([k2], [out]) == [Status.OK] and out == b2
        assert dev.calls["read"] >= 3
    finally:
        a.close()


def test_a_full_device_refuses_writes_and_the_adapter_says_so(tmp_path):
    dev = FaultyDevice(_native.IoEngine(1))
    a = nvme(tmp_path, dev)
    try:
        dev.fail_writes(errno.ENOSPC)
        blobs = {os.urandom(16): os.urandom(100_000) for _ in range(6)}  # more than one region
        a.put(list(blobs), list(blobs.values()))
        a.flush(timeout_s=10)
        assert a.stats()["write_errors"] >= 1
        for k, b in blobs.items():  # whatever it still reports held reads back exact
            out = bytearray(len(b))
            st = a.get([k], [out])[0]
            assert st in (Status.OK, Status.NOT_FOUND) and (st is not Status.OK or out == b)
    finally:
        a.close()


def test_faulty_adapter_answers_what_it_is_told_and_passes_the_rest(tmp_path):
    inner = DramAdapter(1 << 20, DramConfig(path=str(tmp_path)))
    a = FaultyAdapter(inner)
    try:
        key, blob = os.urandom(16), os.urandom(4096)
        a.fail("put", Status.NO_SPACE, times=1)
        assert a.put([key], [blob]) == [Status.NO_SPACE] and a.contains([key]) == [False]
        assert a.put([key], [blob]) == [Status.OK]
        a.raise_on("get", OSError("the device went away"), times=1)
        with pytest.raises(OSError, match="went away"):
            a.get([key], [bytearray(4096)])
        out = bytearray(4096)
        assert a.get([key], [out]) == [Status.OK] and out == blob
        assert a.segment_path == inner.segment_path  # the wrapped adapter's own abilities
        assert a.calls["put"] == 2 and a.calls["get"] == 2
        with pytest.raises(ArgumentError, match="unknown operation 'write'"):
            a.raise_on("write", OSError())
    finally:
        a.close()


def test_a_sealer_that_raises_is_a_failed_write_and_the_adapter_goes_on(tmp_path):
    """Anything raised while a region is written (here by the device) is
    that region's failed write: the sealer thread lives on, later puts seal."""
    dev = FaultyDevice(_native.IoEngine(1))
    a = NvmeAdapter(8 * RS, NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS, write_buffers=1,
                                       retry_after_s=0.0), device=dev)
    try:
        raised = []

        def before(op):
            if op == "write" and not raised:
                raised.append(op)
                raise RuntimeError("injected: a bug in the write path")

        dev.before = before
        k1 = os.urandom(16)
        assert a.put([k1], [os.urandom(50_000)]) == [Status.OK]
        a.flush(timeout_s=10)
        assert raised and a.stats()["write_errors"] == 1
        k2, b2 = os.urandom(16), os.urandom(50_000)
        assert a.put([k2], [b2]) == [Status.OK]
        assert a.flush(timeout_s=10)
        out = bytearray(len(b2))
        assert a.get([k2], [out]) == [Status.OK] and out == b2
    finally:
        a.close()


class LyingDevice:
    """An I/O engine whose reads report every byte read and write none."""

    def __init__(self, inner):
        self.inner = inner
        self.lie = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_batch(self, fd, bufs, offsets):
        if self.lie:
            return [len(memoryview(b)) for b in bufs]
        return self.inner.read_batch(fd, bufs, offsets)


def test_reads_through_warm_scratch_never_hand_on_an_earlier_reads_bytes(tmp_path):
    """Blocks whose length is not whole pages are read (O_DIRECT) through
    scratch kept warm from one read to the next: the same mapping serves
    every read, and a read that lands nothing in it, over the bytes of an
    earlier block of the same length, is CORRUPT, never that block."""
    dev = LyingDevice(_native.IoEngine(1))
    a = nvme(tmp_path, dev)
    try:
        (k1, b1), (k2, b2) = two_blocks(a)
        out = bytearray(len(b1))
        for _ in range(3):
            assert a.get([k1], [out]) == [Status.OK] and out == b1
        assert a.get([k2], [out]) == [Status.OK] and out == b2
        assert a._scratch.made == 1  # warm: one mapping for every read
        assert a.get([k1], [out]) == [Status.OK]  # the scratch holds k1's bytes now
        dev.lie = True
        out[:] = bytes(len(out))
        assert a.get([k2], [out]) == [Status.CORRUPT]
        assert out != b1
    finally:
        a.close()
