"""The scheduler half of UCMConnector over a request's life after its
lookup: preemption (pins given back, saves planned again on resume),
invalid blocks and lost loads, the bound on what waiting requests pin,
cache faults answered as misses, and shutdown. Same fakes and geometry
as test_vllm_scheduler.py (256-token blocks of two 128-token pages)."""
from collections import Counter

import pytest

pytest.importorskip("vllm")
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from test_vllm_scheduler import _blocks, _cache, _output, _request, _side  # noqa: E402

PAGES = [1, 2, 3, 4, 5, 6, 7]


def _three_block_hit():
    """A request of 800 tokens whose three full blocks are in DRAM, looked
    up (all three pinned) and given its 7 pages: (side, cache, request, keys)."""
    side, cache = _side()
    tokens = list(range(800))
    keys = _cache(cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks(PAGES), 768)
    return side, cache, req, keys


def test_preemption_unpins_and_the_resumed_request_looks_up_again_with_its_new_pages():
    side, cache, req, keys = _three_block_hit()
    side.build_connector_meta(_output(new=[("r1", PAGES, 768, 32)]))
    meta = side.build_connector_meta(_output(preempted={"r1"}))
    assert meta.preempted == {"r1"} and cache.pinned() == 0
    del cache.tiers[keys[2]]  # the fresh lookup sees the cache as it is now
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    assert cache.pins == Counter(keys[:2])
    side.update_state_after_alloc(req, _blocks([8, 9, 10, 11, 12, 13, 14]), 512)
    [job] = side.build_connector_meta(_output(cached=[("r1", [8, 9, 10, 11, 12, 13, 14], 512, 288, True)])).loads
    assert job.page_ids == [[8, 9], [10, 11]]
    side.request_finished(req, [])
    assert cache.pinned() == 0


def test_blocks_whose_save_a_preemption_dropped_are_planned_again_on_resume():
    side, cache = _side()
    tokens = list(range(800))
    req = _request("r1", tokens)
    keys = side.request_keys(req)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6, 7]), 0)
    [s] = side.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5, 6, 7], 0, 800)])).stores
    assert s.keys == keys
    cache.tiers[keys[0]] = "dram"  # the worker saved block 0; the preemption dropped blocks 1 and 2
    side.build_connector_meta(_output(preempted={"r1"}))
    side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert side.get_num_new_matched_tokens(req, 0) == (256, False)
    side.update_state_after_alloc(req, _blocks([8, 9, 10, 11, 12, 13, 14]), 256)
    meta = side.build_connector_meta(_output(cached=[("r1", [8, 9, 10, 11, 12, 13, 14], 256, 544, True)]))
    [s] = meta.stores
    assert (s.keys, s.page_ids, s.parent) == (keys[1:], [[10, 11], [12, 13]], keys[0])


def test_invalid_blocks_reset_the_request_and_two_lost_loads_stop_ucm_for_it():
    side, cache = _side()
    tokens = list(range(800))
    _cache(cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    pages = [1, 2, 3, 4, 5, 6, 7]
    for _ in range(2):
        assert side.get_num_new_matched_tokens(req, 0) == (768, False)
        assert cache.pinned() == 3
        side.update_state_after_alloc(req, _blocks(pages), 768)
        side.build_connector_meta(_output(new=[("r1", pages, 768, 32)]))
        side.update_connector_output(KVConnectorOutput(invalid_block_ids={4}))  # block 1's second page
        assert cache.pinned() == 0
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # computed without ucm's help
    meta = side.build_connector_meta(_output(cached=[("r1", None, 0, 800, False)]))
    assert [s.page_ids for s in meta.stores] == [[[3, 4], [5, 6]]]  # blocks 1 and 2, recomputed, saved again


def test_an_invalid_block_of_another_request_leaves_this_one_alone():
    side, cache, req, keys = _three_block_hit()
    side.update_connector_output(KVConnectorOutput(invalid_block_ids={40}))
    assert cache.pins == Counter(keys)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)


def test_waiting_requests_pin_at_most_the_cap_and_beyond_it_count_as_misses():
    side, cache = _side(cap_blocks=3)
    a_tokens, b_tokens = list(range(600)), list(range(5000, 5800))
    _cache(cache, a_tokens, ["dram"] * 2)
    _cache(cache, b_tokens, ["dram"] * 3)
    a, b = _request("a", a_tokens), _request("b", b_tokens)
    assert side.get_num_new_matched_tokens(a, 0) == (512, False)  # vLLM has no pages for a: it waits
    assert side.get_num_new_matched_tokens(b, 0) == (256, False)  # one block of room left
    assert cache.pinned() == 3
    assert side.get_num_new_matched_tokens(b, 0) == (256, False)  # still no room: no churn
    assert cache.pinned() == 3
    side.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5]), 512)  # a runs: its pins leave the budget
    assert side.get_num_new_matched_tokens(b, 0) == (768, False)  # b looks up again, now with room
    assert cache.pinned() == 5
    side.request_finished(a, [])
    side.request_finished(b, [])
    assert cache.pinned() == 0 and side.waiting_pinned_blocks == 0


def test_the_only_waiting_request_pins_its_whole_hit_past_the_cap():
    """The cap bounds a queue of waiting requests, not one long prompt: with
    no other pins waiting, a hit larger than the cap is served whole."""
    side, cache = _side(cap_blocks=1)
    a_tokens, b_tokens = list(range(800)), list(range(5000, 5800))
    _cache(cache, a_tokens, ["dram"] * 3)
    _cache(cache, b_tokens, ["dram"] * 3)
    assert side.get_num_new_matched_tokens(_request("a", a_tokens), 0) == (768, False)
    assert cache.pinned() == 3
    assert side.get_num_new_matched_tokens(_request("b", b_tokens), 0) == (0, False)  # a waits with 3
    assert cache.pinned() == 3


def test_a_finished_waiting_request_gives_its_pin_budget_back():
    side, cache = _side(cap_blocks=2)
    tokens = list(range(600))
    _cache(cache, tokens, ["dram"] * 2)
    assert side.get_num_new_matched_tokens(_request("a", tokens), 0) == (512, False)
    assert side.get_num_new_matched_tokens(_request("b", tokens), 0) == (0, False)  # no room
    assert side.request_finished(_request("a", tokens), []) == (False, None)  # aborted while waiting
    assert side.get_num_new_matched_tokens(_request("b", tokens), 0) == (512, False)


def test_a_preempted_request_returns_to_the_waiting_budget():
    side, cache = _side(cap_blocks=2)
    a_tokens, b_tokens = list(range(600)), list(range(5000, 5600))
    _cache(cache, a_tokens, ["dram"] * 2)
    _cache(cache, b_tokens, ["dram"] * 2)
    a, b = _request("a", a_tokens), _request("b", b_tokens)
    side.get_num_new_matched_tokens(a, 0)
    side.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5]), 512)
    assert side.waiting_pinned_blocks == 0
    side.build_connector_meta(_output(preempted={"a"}))
    assert side.get_num_new_matched_tokens(a, 0) == (512, False)  # a waits again, pinning 2
    assert side.waiting_pinned_blocks == 2
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)  # the budget is a's


@pytest.mark.parametrize("broken", ["lookup", "pin", "locate"])
def test_a_cache_fault_while_looking_up_is_a_miss_never_an_exception(broken):
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram"] * 2)
    cache.broken.add(broken)
    got = side.get_num_new_matched_tokens(_request("r1", tokens), 0)
    if broken == "locate":  # the hit stands; where it lies is unknown, so it loads in the background
        assert got == (512, True)
    else:
        assert got == (0, False) and cache.pinned() == 0


def test_faulty_request_events_do_not_stop_the_request():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram"] * 2)
    cache.broken |= {"begin_request", "finish", "unpin"}
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 512)
    assert side.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)
    assert side.waiting_pinned_blocks == 0


def test_shutdown_releases_the_pins_of_requests_still_in_flight():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram"] * 2)
    side.get_num_new_matched_tokens(_request("r1", tokens), 0)
    assert cache.pinned() == 2
    side.shutdown()
    assert cache.pinned() == 0
