"""A staging whose `planned` callback raises (the streamed load's hook,
called after the staging's steps were admitted to the tier stack): the
admitted steps still run, so later operations on the same keys, which wait
for those steps in key order, are not held up forever."""
import hashlib
import threading

from ucm.cache.staging import Stager
from ucm.cache.unified import Outcome, UnifiedCache

KiB = 1024
SIZE = 64 * KiB


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": "1MiB"},
                      {"adapter": "nvme", "capacity": "16MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "64KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def blocks(n):
    keys = [hashlib.blake2b(f"b{i}".encode(), digest_size=16).digest() for i in range(n)]
    return keys, [hashlib.shake_128(k).digest(SIZE) for k in keys]


def test_a_planned_callback_that_raises_leaves_no_admitted_step_behind(nvme_dir, caplog):
    with UnifiedCache(cfg(nvme_dir)) as c:
        keys, blobs = blocks(40)  # 2.5 MiB through a 1 MiB DRAM tier: the first ones are demoted to NVMe
        for k, b in zip(keys, blobs):
            assert c.store([k], [b]).wait(30) == [Outcome.DONE]
        below = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"][:4]
        assert len(below) == 4

        def boom(others):
            raise RuntimeError("a planned() callback that fails")

        Stager(c.core).stage(below, force=True, planned=boom)
        assert "planned() callback failed" in caplog.text

        got = [bytearray(SIZE) for _ in below]
        done = threading.Event()
        result = []

        def later_load():  # waits in key order behind the staging's steps
            result.extend(c.load(below, got).wait(30))
            done.set()

        threading.Thread(target=later_load, daemon=True).start()
        assert done.wait(60), "a load of the staged keys never got its turn"
        want = {k: b for k, b in zip(keys, blobs)}
        assert result == [Outcome.DONE] * 4
        assert [bytes(g) for g in got] == [want[k] for k in below]
