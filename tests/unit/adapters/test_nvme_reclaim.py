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
