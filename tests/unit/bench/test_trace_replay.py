"""TraceReplay on hand-made traces: prefix semantics, capacities, per-tier counts."""
import pytest

from ucm.bench.cache.replay import INF, CostModel, TraceReplay, block_key, next_uses
from ucm.errors import ArgumentError
from ucm.placement import TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy
from ucm.bench.cache.traces import TraceRequest


def requests(*id_lists):
    return [TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids))
            for i, ids in enumerate(id_lists)]


def replay(tiers, policy="lru", cost=None):
    placement = make_placement([TierSpec(name, cap) for name, cap in tiers], load_policy(policy),
                               heat=HeatTracker())
    return TraceReplay(placement, cost or CostModel(block_bytes=1, tier_gbps=(1.0, 1.0)),
                       policy_name=policy)


def ids(placement, t):
    return sorted(int.from_bytes(k, "little") for k in placement.resident_keys(t))


def hit_lengths(rp, reqs):
    return [len(rp.run_request([block_key(h) for h in r.hash_ids], r.block_tokens(), nu))
            for r, nu in zip(reqs, next_uses(reqs))]


def test_hits_are_the_longest_cached_prefix_and_lru_evicts_leaves_first():
    rp = replay([("dram", 4)])
    reqs = requests([1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3])
    # r2 hits 1,2 and stores 4; r3 hits 1 and evicts 3 (the least recent
    # leaf) for 5; r4 hits 1,2, misses 3 and evicts 4 for it (2 is its parent).
    assert hit_lengths(rp, reqs) == [0, 2, 1, 2]
    assert ids(rp.placement, 0) == [1, 2, 3, 5]
    r = rp.result
    assert (r.blocks, r.hits, r.misses) == (11, 5, 6)


def test_a_cached_block_after_a_miss_is_not_a_hit():
    """Ids that are not chained (2 and 3 follow 1, then 9): 2 and 3 stay
    cached but do not count, since 9 before them missed."""
    rp = replay([("dram", 8)])
    assert hit_lengths(rp, requests([1, 2, 3], [9, 2, 3])) == [0, 0]
    assert ids(rp.placement, 0) == [1, 2, 3, 9]  # after a request all its blocks are cached


def test_after_a_request_all_its_blocks_are_cached():
    rp = replay([("dram", 6)])
    for req in requests([1, 2, 3], [4, 5], [1, 2, 6, 7]):
        rp.run_request([block_key(h) for h in req.hash_ids], req.block_tokens())
        assert all(rp.placement.contains(block_key(h)) for h in req.hash_ids)


def test_a_request_longer_than_the_tier_stores_what_fits():
    rp = replay([("dram", 3)])
    assert hit_lengths(rp, requests([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])) == [0, 3]
    assert rp.placement.used_bytes(0) == 3
    assert rp.result.refused == 2


def test_two_tiers_count_hits_and_nvme_writes_per_tier():
    """DRAM 3 blocks over NVMe 3 blocks, LRU (write-all):
    r1 [1,2,3] fills DRAM. r2 [4,5] demotes 3, then 2, to NVMe.
    r3 [1,2,3] hits 1 in DRAM, 2 and 3 in NVMe; promoting 2 demotes 5,
    promoting 3 demotes 4, which drops 5 from the full NVMe (3 and 2 are
    being read)."""
    rp = replay([("dram", 3), ("nvme", 3)])
    reqs = requests([1, 2, 3], [4, 5], [1, 2, 3])
    assert hit_lengths(rp, reqs) == [0, 0, 3]
    p, r = rp.placement, rp.result
    assert (ids(p, 0), ids(p, 1)) == ([1, 2, 3], [2, 3, 4])
    d = r.to_dict()
    assert (d["dram_hits"], d["nvme_hits"], d["misses"]) == (1, 2, 5)
    assert (r.promotions, r.demotions) == (2, 4)
    assert d["nvme_bytes_written"] == 4  # demotions of 3, 2, 5, 4
    assert d["dram_bytes_written"] == 7  # 5 stores and 2 promotions
    assert d["hit_ratio"] == pytest.approx(3 / 8)


def test_prefill_saved_ratio_follows_the_cost_model():
    cost = CostModel(prefill_ms_per_token=0.5, block_bytes=10**6, tier_gbps=(10.0, 1.0))
    rp = replay([("dram", 10**7)], cost=cost)
    reqs = [TraceRequest(1, 0.0, 1100, 0, (1, 2, 3)), TraceRequest(2, 1.0, 600, 0, (1, 2))]
    r = rp.replay(reqs)
    # hits: blocks 1 and 2 of request 2 (512 and 88 tokens) from DRAM, 0.1 ms each to load
    saved = 0.5 * (512 + 88) - 2 * 0.1
    assert r.prefill_saved_ratio == pytest.approx(saved / (0.5 * (1100 + 600)))
    assert r.token_hit_ratio == pytest.approx(600 / 1700)


def test_next_uses_point_at_the_next_request_holding_the_block():
    reqs = requests([1, 2], [3], [1, 2, 4], [1])
    assert next_uses(reqs) == [[3.0, 3.0], [INF], [4.0, INF, INF], [INF]]
    assert next_uses(reqs, start=10)[0] == [13.0, 13.0]


def test_cost_model_rejects_nonsense():
    with pytest.raises(ArgumentError):
        CostModel(prefill_ms_per_token=0)
    with pytest.raises(ArgumentError):
        CostModel(tier_gbps=(10.0, -1.0))


def test_replay_needs_a_bandwidth_per_tier():
    placement = make_placement([TierSpec("dram", 4), TierSpec("nvme", 4)], load_policy("lru"))
    with pytest.raises(ArgumentError):
        TraceReplay(placement, CostModel(block_bytes=1, tier_gbps=(1.0,)))
