"""Issue #16, `ucm bench prefetch`: why `wait_complete` / `timeout` lost to
`off`. A request that waits for its staging pinned its whole hit against
the waiting-pin cap (a quarter of DRAM, about one document), so the second
queued request pinned nothing and was computed cold; its own staged blocks
counted against the cap again once they reached DRAM; a staging over the
staging budget was never issued, even after the budget freed; a staging
that came back short, or a hit cut at the cap, recomputed the rest.

The scheduler side now: charges the waiting-pin cap only for pins that hold
landing-tier room (blocks in DRAM that its own staging did not bring);
queues stagings over the budget in arrival order and issues them as the
budget frees; loads the blocks a short staging left below DRAM as without
a policy; and lets a capped request wait (bounded) for room. Same fakes
and geometry as test_vllm_scheduler.py (256-token blocks of two pages)."""
import pytest

pytest.importorskip("vllm")
from test_vllm_scheduler import _blocks, _cache, _output, _request, _side  # noqa: E402

TOKENS = list(range(3 * 256 + 10))  # three full blocks and a partial one


def _doc(i):
    return [t + 100_000 * i for t in TOKENS]


def test_waiting_requests_pin_blocks_below_dram_without_using_the_cap():
    """Pins of NVMe-only blocks hold no DRAM (a pinned block leaves a tier
    whenever another holds it): a queue of such requests all keep their
    hit and are all staged while they wait."""
    side, cache = _side(cap_blocks=1, prefetch_policy="wait_complete")
    reqs = [_request(f"r{i}", _doc(i)) for i in range(3)]
    for i, r in enumerate(reqs):
        _cache(cache, _doc(i), ["nvme"] * 3)
        side.on_new_request(r)
    assert [len(p[0]) for p in cache.prefetches] == [3, 3, 3]
    assert side.waiting_pinned_blocks == 0 and cache.pinned() == 9
    for i in range(3):
        cache.stage(i)
    for r in reqs:
        assert side.get_num_new_matched_tokens(r, 0) == (768, False)  # all from DRAM, synchronously
    assert side.staging_stats()["short"] == 0 and side.staging_stats()["over_budget"] == 0


def test_a_requests_own_staged_blocks_do_not_count_against_the_cap():
    """Its staged blocks are bounded by the staging budget; charging them to
    the waiting-pin cap too cut the hit once the staging landed."""
    side, cache = _side(cap_blocks=2, prefetch_policy="wait_complete")
    a_tokens, other = _doc(1), _doc(2)
    _cache(cache, a_tokens, ["nvme"] * 3)
    _cache(cache, other, ["dram"] * 2)
    a, b = _request("a", a_tokens), _request("b", other)
    side.on_new_request(a)  # staging its 3 blocks
    assert side.get_num_new_matched_tokens(b, 0) == (512, False)  # b waits for pages, pinning 2 in DRAM
    assert side.waiting_pinned_blocks == 2
    cache.stage(0)
    assert side.get_num_new_matched_tokens(a, 0) == (768, False)  # whole, though the cap is used up
    assert side._reqs["a"].staging_losses == 0


def test_stagings_over_the_budget_are_issued_in_arrival_order_as_it_frees():
    side, cache = _side(prefetch_policy="wait_complete")
    side.stagings.budget.max_blocks = 3
    reqs = [_request(f"r{i}", _doc(i)) for i in range(3)]
    keys = [_cache(cache, _doc(i), ["nvme"] * 3) for i in range(3)]
    for r in reqs:
        side.on_new_request(r)
    assert [p[0] for p in cache.prefetches] == [keys[0]]  # r1 and r2 queue for the budget
    cache.stage(0)
    assert side.get_num_new_matched_tokens(reqs[0], 0) == (768, False)
    side.update_state_after_alloc(reqs[0], _blocks(list(range(1, 8))), 768)  # r0 loads: budget frees
    assert [p[0] for p in cache.prefetches] == [keys[0], keys[1]]  # r1 is next, r2 still queued
    assert side.stagings.budget.used == 3
    cache.stage(1)
    assert side.get_num_new_matched_tokens(reqs[1], 0) == (768, False)
    assert side.staging_stats()["over_budget"] == 0


def test_a_queued_request_vllm_schedules_first_loads_as_without_a_policy():
    """No wait for the budget: vLLM wants to run it now, so its NVMe hit is
    loaded asynchronously (as with `off`) and it leaves the queue."""
    side, cache = _side(prefetch_policy="wait_complete")
    side.stagings.budget.max_blocks = 3
    a, b, c = (_request(n, _doc(i)) for i, n in enumerate("abc"))
    for i, r in enumerate((a, b, c)):
        _cache(cache, _doc(i), ["nvme"] * 3)
        side.on_new_request(r)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)  # staging
    assert side.get_num_new_matched_tokens(b, 0) == (768, True)  # queued: loaded asynchronously now
    assert side.staging_stats()["over_budget"] == 1
    cache.stage(0)
    assert side.get_num_new_matched_tokens(a, 0) == (768, False)
    side.update_state_after_alloc(a, _blocks(list(range(1, 8))), 768)
    assert len(cache.prefetches) == 2 and cache.prefetches[1][0] == side._reqs["c"].keys  # c, not b


def test_a_short_staging_loads_the_rest_as_without_a_policy_and_is_no_loss():
    side, cache = _side(prefetch_policy="wait_complete")
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    cache.stage(0, refuse={keys[1]})  # block 1 found no room in DRAM
    assert side.get_num_new_matched_tokens(req, 0) == (768, True)  # block 1 comes from NVMe, in the background
    assert side._reqs["r"].staging_losses == 0 and side.staging_stats()["short"] == 1
    side.update_state_after_alloc(req, _blocks(list(range(1, 8))), 768)
    [job] = side.build_connector_meta(_output()).loads
    assert job.is_async and job.keys == keys


def test_a_capped_waiting_request_waits_for_room_instead_of_a_short_hit():
    side, cache = _side(cap_blocks=2, prefetch_policy="wait_complete")
    a_tokens, b_tokens = _doc(1), _doc(2)
    _cache(cache, a_tokens, ["dram"] * 2)
    _cache(cache, b_tokens, ["dram"] * 3)
    a, b = _request("a", a_tokens), _request("b", b_tokens)
    assert side.get_num_new_matched_tokens(a, 0) == (512, False)  # a waits for pages, pinning the cap
    assert side.get_num_new_matched_tokens(b, 0) == (None, False)  # b: no room; asks again
    assert cache.pinned() == 2
    side.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5]), 512)  # a runs: room frees
    assert side.get_num_new_matched_tokens(b, 0) == (768, False)  # the whole hit
    assert side._reqs["b"].staging_losses == 0 and side.staging_stats()["capped_waits"] == 1


def test_a_capped_request_stops_waiting_at_its_deadline_with_the_hit_it_has():
    """Never a stall: `timeout` waits for room at most its timeout; then the
    hit cut at the cap is answered, and no loss is counted."""
    side, cache = _side(cap_blocks=2, prefetch_policy="timeout", prefetch_timeout_s=0,
                        prefetch_timeout_per_1k_tokens_s=0)
    a_tokens, b_tokens = _doc(1), _doc(2)
    _cache(cache, a_tokens, ["dram"] * 2)
    _cache(cache, b_tokens, ["dram"] * 3)
    a, b = _request("a", a_tokens), _request("b", b_tokens)
    assert side.get_num_new_matched_tokens(a, 0) == (512, False)
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)  # no room, no wait: computed
    assert side._reqs["b"].staging_losses == 0


def test_without_a_policy_a_capped_request_still_answers_at_once():
    side, cache = _side(cap_blocks=2, load_streaming="off")
    a_tokens, b_tokens = _doc(1), _doc(2)
    _cache(cache, a_tokens, ["dram"] * 2)
    _cache(cache, b_tokens, ["dram"] * 3)
    assert side.get_num_new_matched_tokens(_request("a", a_tokens), 0) == (512, False)
    assert side.get_num_new_matched_tokens(_request("b", b_tokens), 0) == (0, False)


def test_a_finished_request_leaves_the_staging_queue_and_frees_its_place():
    side, cache = _side(prefetch_policy="wait_complete")
    side.stagings.budget.max_blocks = 3
    a, b = _request("a", _doc(0)), _request("b", _doc(1))
    _cache(cache, _doc(0), ["nvme"] * 3)
    _cache(cache, _doc(1), ["nvme"] * 3)
    side.on_new_request(a)
    side.on_new_request(b)  # queued behind a
    assert len(cache.prefetches) == 1
    side.request_finished(a, [])  # aborted while staging: its share frees, b is staged
    assert len(cache.prefetches) == 2 and side.stagings.budget.used == 3
    side.request_finished(b, [])
    assert side.stagings.budget.used == 0 and cache.pinned() == 0 and side.waiting_pinned_blocks == 0
