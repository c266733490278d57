"""The transformers connector's parts without a model or a connector:
UCMCache (request_cache.py) driven through its public methods with two
recording functions in place of the connector, and CallGuard (guard.py),
where a cache fault is a miss."""
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ucm.connectors.transformers.guard import CallGuard  # noqa: E402
from ucm.connectors.transformers.prompt_rows import PromptRow  # noqa: E402
from ucm.connectors.transformers.request_cache import UCMCache  # noqa: E402

LAYERS, H, D = 2, 1, 4


def _cache(events, prompt_len=6, **kw):
    rows = [PromptRow(0, [b"k0"], "r-0", True)]
    return UCMCache(rows, prompt_len, LAYERS, on_forward=lambda c: events.append(("forward", c)),
                    on_finish=lambda c, n: events.append(("finish", n)), **kw)


def _forward(cache, tokens):
    for layer in range(LAYERS):
        cache.update(torch.zeros(1, H, tokens, D), torch.zeros(1, H, tokens, D), layer)


def test_a_forward_schedules_its_stores_after_the_last_layer_and_finish_runs_once():
    events = []
    cache = _cache(events)
    cache.expect_new(6)
    _forward(cache, 6)
    assert events == [("forward", cache)]
    cache.stop_storing()
    _forward(cache, 1)
    assert events == [("forward", cache)] and not cache.storing
    cache.finish()
    cache.finish()
    assert events[1:] == [("finish", 2)]  # 7 positions seen, 6 of them the prompt: 2 tokens generated


def test_with_store_after_token_the_stores_wait_for_the_next_forward():
    events = []
    cache = _cache(events, store_after_token=True)
    _forward(cache, 6)
    assert events == []
    _forward(cache, 1)  # the first forward's token is out: its stores now
    assert events == [("forward", cache)]
    cache.store_due()
    assert len(events) == 2


def test_a_first_forward_of_other_input_ids_stores_nothing():
    events = []
    cache = _cache(events)
    cache.expect_new(6)
    _forward(cache, 4)
    assert events == [] and not cache.storing


def test_recompute_gives_a_fresh_cache_for_the_same_rows_and_the_old_one_finishes_nothing():
    events = []
    cache = _cache(events)
    fresh = cache.recompute()
    assert [(r.keys, r.request_id, r.stored) for r in fresh.rows] == [([b"k0"], "r-0", 0)]
    assert fresh.rows[0] is not cache.rows[0] and fresh.storing and not cache.storing
    cache.finish()
    assert events == []
    _forward(fresh, 6)
    fresh.finish(3)
    assert events == [("forward", fresh), ("finish", 3)]


def test_the_guard_answers_a_fault_with_the_default_counts_it_and_warns_once(caplog):
    guard = CallGuard(logging.getLogger("test.guard"))

    def boom():
        raise OSError("down")

    with caplog.at_level(logging.DEBUG, logger="test.guard"):
        assert guard.call("lookup", boom, default=0) == 0
        assert guard.call("lookup", boom, default=0) == 0
        assert guard.call("lookup", lambda: 3, default=0) == 3
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG]
    guard.count("hit_blocks", 2)
    assert guard.counts()["faults"] == 2 and guard.counts()["hit_blocks"] == 2
