"""nvme reclamation reads the victim region without holding the adapter's
lock: readers, deletes and stats go on meanwhile, and what they did is
reconciled (a block deleted meanwhile does not come back)."""
import os
import threading

from ucm.adapters.base import Status
from ucm.adapters.nvme import NvmeAdapter, NvmeConfig

RS = 64 << 10
SIZE = 20_000  # three blocks and a footer per region


class GatedIo:
    """The adapter's real I/O engine, with a hook run (on the calling
    thread) before the first read issued by `thread` once armed."""

    def __init__(self, io, thread, hook):
        self._io, self._thread, self._hook, self.armed = io, thread, hook, False

    def read_batch(self, fd, bufs, offsets):
        if self.armed and threading.current_thread() is self._thread:
            self.armed = False
            self._hook()
        return self._io.read_batch(fd, bufs, offsets)

    def write_batch(self, fd, bufs, offsets):
        return self._io.write_batch(fd, bufs, offsets)

    @property
    def threads(self):
        return self._io.threads


def test_victim_region_is_read_without_the_lock(tmp_path):
    a = NvmeAdapter(3 * RS, NvmeConfig(path=str(tmp_path), region_size=RS, io_chunk=RS, write_buffers=1))
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

        gate = GatedIo(a._io, threading.current_thread(), during_reclaim)
        a._io = gate  # wraps the real engine: the seam the adapter reads the medium through
        gate.armed = True
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
