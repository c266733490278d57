"""The prefetch accelerator's bookkeeping against a fake cache whose
staging completes when the test says (review fixes: a prefetch that raises
gives its blocks back; a request that finishes while its blocks are still
being staged counts them wasted when they arrive)."""
import pytest

from ucm.accelerators.base import BlocksLoaded, RequestFinished, RequestSeen
from ucm.accelerators.prefetch import Prefetch
from ucm.api import Handle, Outcome
from ucm.config import UcmConfig
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
    acc = Prefetch(cache, CONFIG, max_inflight_blocks=4)
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
    acc = Prefetch(cache, CONFIG)
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
    acc = Prefetch(cache, CONFIG)
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
