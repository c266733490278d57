"""nvme reclamation reads the victim region without holding the adapter's
lock: readers, deletes and stats go on meanwhile, and what they did is
reconciled (a block deleted meanwhile does not come back)."""
import os
import threading

from ucm import _native
from ucm.adapters.base import Status
from ucm.adapters.faults import FaultyDevice
from ucm.adapters.nvme import NvmeAdapter, NvmeConfig

RS = 64 << 10
SIZE = 20_000  # three blocks and a footer per region


def test_victim_region_is_read_without_the_lock(tmp_path):
    conf = NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS, write_buffers=1)
    device = FaultyDevice(_native.IoEngine(conf.io_threads))  # the real engine, behind the seam
    a = NvmeAdapter(3 * RS, conf, device=device)
    try:
        keys = [os.urandom(16) for _ in range(9)]
        data = {k: os.urandom(SIZE) for k in keys}
        for k in keys:  # fills the three regions
            assert a.put([k], [data[k]]) == [Status.OK]
        assert a.flush()
        deleted = keys[1]
        assert a.delete([deleted]) == [True]  # region 0 has the fewest live bytes: the next victim
        seen = {}

        def during_reclaim():
            def other():  # another thread, while the victim is being read back
                out = bytearray(SIZE)
                seen["get"] = (a.get([keys[0]], [out])[0], bytes(out) == data[keys[0]])  # a victim block
                seen["contains"] = a.contains([keys[2], keys[5]])
                seen["delete"] = a.delete([keys[2]])
                seen["stats"] = a.stats()["blocks"]
            t = threading.Thread(target=other)
            t.start()
            t.join(20)  # a deadlock bound, not a timing: with the lock held here `other` could never finish
            seen["finished"] = not t.is_alive()

        me, armed = threading.current_thread(), [True]

        def before(op):  # the first read this thread issues from now on: the victim read
            if op == "read" and armed and threading.current_thread() is me:
                armed.clear()
                during_reclaim()

        device.before = before
        new = os.urandom(16)
        data[new] = os.urandom(SIZE)
        assert a.put([new], [data[new]]) == [Status.OK]  # no free region: reclaims region 0
        assert seen.get("finished") is True
        assert seen["get"] == (Status.OK, True)
        assert seen["contains"] == [True, True] and seen["delete"] == [True]
        assert a.contains([keys[0], keys[2], deleted, new]) == [True, False, False, True]
        assert a.drain_dropped() == []  # deleted by the owner, not dropped by the adapter
        assert a.stats()["regions_reclaimed"] == 1
        assert a.flush()
        live = [k for k in keys if k not in (deleted, keys[2])] + [new]
        for k in live:
            out = bytearray(SIZE)
            assert a.get([k], [out]) == [Status.OK] and out == data[k]
    finally:
        a.close()
    b = NvmeAdapter(3 * RS, NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS))
    try:
        assert sorted(b.iter_keys()) == sorted(live)
    finally:
        b.close()


class BlockingVictimReads:
    """The real engine, except that a read inside region `victim` waits for
    `release` once armed (and says so through `entered`)."""

    def __init__(self, inner, region_size):
        self.inner, self.rs = inner, region_size
        self.victim = None
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_batch(self, fd, bufs, offsets):
        if self.victim is not None and all(o // self.rs == self.victim for o in offsets):
            self.victim = None
            self.entered.set()
            assert self.release.wait(30)
        return self.inner.read_batch(fd, bufs, offsets)

    def write_batch(self, fd, bufs, offsets):
        return self.inner.write_batch(fd, bufs, offsets)


def test_a_get_of_another_region_completes_while_the_victim_read_is_blocked(tmp_path):
    conf = NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS, write_buffers=1)
    device = BlockingVictimReads(_native.IoEngine(conf.io_threads), RS)
    a = NvmeAdapter(3 * RS, conf, device=device)
    try:
        keys = [os.urandom(16) for _ in range(9)]
        data = {k: os.urandom(SIZE) for k in keys}
        for k in keys:  # regions 0, 1, 2: three blocks each
            assert a.put([k], [data[k]]) == [Status.OK]
        assert a.flush()
        assert a.delete([keys[1]]) == [True]  # region 0 is the next victim
        device.victim = 0
        new = os.urandom(16)
        result = {}
        writer = threading.Thread(target=lambda: result.setdefault("put", a.put([new], [os.urandom(SIZE)])))
        writer.start()
        assert device.entered.wait(20)  # the writer is inside the victim's read, and stays there
        other, victim_block = bytearray(SIZE), bytearray(SIZE)
        assert a.get([keys[4]], [other]) == [Status.OK] and other == data[keys[4]]  # region 1
        assert a.contains([keys[0], keys[4]]) == [True, True]
        assert writer.is_alive() and "put" not in result  # the reclaim is still blocked
        device.release.set()
        writer.join(20)
        assert result["put"] == [Status.OK]
        assert a.get([keys[0]], [victim_block]) == [Status.OK] and victim_block == data[keys[0]]  # reinserted
    finally:
        device.release.set()
        a.close()
