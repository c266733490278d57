"""The prefetch accelerator's bookkeeping against a fake cache whose
staging completes when the test says (review fixes: a prefetch that raises
gives its blocks back; a request that finishes while its blocks are still
being staged counts them wasted when they arrive)."""
import pytest

from ucm.accelerators.base import BlocksLoaded, RequestFinished, RequestSeen
from ucm.accelerators.prefetch import PrefetchAccelerator
from ucm.api import Handle, Outcome
from ucm.config.schema import UcmConfig
from ucm.errors import ClosedError

CONFIG = UcmConfig.model_validate({"tiers": [{"adapter": "dram", "capacity": "1MiB"},
                                             {"adapter": "nvme", "capacity": "8MiB", "options": {"path": "/tmp"}}]})


class FakeCache:
    def __init__(self):
        self.handles = []
        self.closed = False

    def prefetch(self, keys, tier=None):
        if self.closed:
            raise ClosedError("closed")
        h = Handle(len(keys))
        self.handles.append(h)
        return h


def key(i):
    return i.to_bytes(16, "little")


def seen(rid, n, tier="nvme"):
    keys = tuple(key(i) for i in range(n))
    return RequestSeen(rid, keys, None, (tier,) * n, (100,) * n)


def test_a_prefetch_that_raises_gives_its_blocks_back():
    cache = FakeCache()
    acc = PrefetchAccelerator(cache, CONFIG, max_inflight_blocks=4)
    cache.closed = True
    for rid in ("a", "b", "c"):
        with pytest.raises(ClosedError):
            acc.request_seen(seen(rid, 2))
    c = acc.counters()
    assert (c["blocks_inflight"], c["requests_staged"], c["blocks_issued"], c["requests_skipped"]) == (0, 0, 0, 0)
    cache.closed = False
    acc.request_seen(seen("d", 4))  # the bound is whole again
    assert acc.counters()["blocks_issued"] == 4


def test_blocks_staged_after_their_request_finished_are_wasted():
    cache = FakeCache()
    acc = PrefetchAccelerator(cache, CONFIG)
    acc.request_seen(seen("r", 3))
    ev = seen("r", 3)
    acc.request_finished(RequestFinished("r", ev.keys, 5))  # before the staging completed
    assert acc.counters()["blocks_wasted"] == 0
    cache.handles[0].resolve([Outcome.DONE, Outcome.DONE, Outcome.MISSING])
    c = acc.counters()
    assert (c["blocks_staged"], c["blocks_wasted"], c["bytes_wasted"], c["blocks_failed"]) == (2, 2, 200, 1)
    assert c["blocks_inflight"] == 0


def test_a_staged_block_read_from_dram_is_used_once():
    cache = FakeCache()
    acc = PrefetchAccelerator(cache, CONFIG)
    ev = seen("r", 2)
    acc.request_seen(ev)
    cache.handles[0].resolve([Outcome.DONE, Outcome.DONE])
    loaded = BlocksLoaded(ev.keys, (Outcome.DONE, Outcome.DONE), ("dram", "nvme"), "r")
    acc.blocks_loaded(loaded)
    acc.blocks_loaded(loaded)
    acc.request_finished(RequestFinished("r", ev.keys, 5))
    c = acc.counters()
    # The second block was read from NVMe (it left DRAM before the read): its staging was wasted.
    assert (c["blocks_used"], c["blocks_wasted"]) == (1, 1)


def test_landed_blocks_of_a_request_that_never_finishes_leave_the_budget_once_stale(monkeypatch):
    import ucm.accelerators.prefetch as prefetch

    now = [1000.0]
    monkeypatch.setattr(prefetch.time, "monotonic", lambda: now[0])
    cache = FakeCache()
    acc = PrefetchAccelerator(cache, CONFIG, max_staged_bytes=300, stale_after_s=60)
    acc.request_seen(seen("lost", 3))  # 300 bytes: the whole budget; its engine dies, it never finishes
    cache.handles[0].resolve([Outcome.DONE] * 3)
    other = RequestSeen("next", tuple(key(100 + i) for i in range(2)), None, ("nvme",) * 2, (100,) * 2)
    now[0] += 30
    acc.request_seen(other)
    assert acc.counters()["requests_over_budget"] == 1  # not stale yet
    now[0] += 31
    acc.request_seen(other)
    c = acc.counters()
    assert (c["requests_over_budget"], c["blocks_wasted"], c["bytes_wasted"]) == (1, 3, 300)
    assert c["blocks_issued"] == 5


def test_blocks_still_being_staged_never_expire(monkeypatch):
    import ucm.accelerators.prefetch as prefetch

    now = [1000.0]
    monkeypatch.setattr(prefetch.time, "monotonic", lambda: now[0])
    cache = FakeCache()
    acc = PrefetchAccelerator(cache, CONFIG, max_staged_bytes=300, stale_after_s=60)
    acc.request_seen(seen("slow", 3))  # its staging has not completed
    now[0] += 600
    acc.request_seen(RequestSeen("next", (key(100),), None, ("nvme",), (100,)))
    c = acc.counters()
    assert (c["requests_over_budget"], c["blocks_wasted"]) == (1, 0)
