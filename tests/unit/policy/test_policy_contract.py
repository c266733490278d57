"""The contract every registered placement policy (`ucm.policies`) keeps."""
import random
from importlib.metadata import entry_points

import pytest

from ucm.bench.cache.replay import CostModel, TraceReplay, block_key, next_uses
from ucm.placement import TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import Admission, PlacementPolicy, TierInfo, load_policy
from ucm.bench.cache.traces import TraceRequest

POLICIES = sorted(ep.name for ep in entry_points(group="ucm.policies"))


def test_every_policy_of_the_issue_is_registered():
    assert {"lru", "fifo", "lfu", "arc", "s3fifo", "tinylfu", "heat", "opt"} <= set(POLICIES)


def make(policy, capacity=10):
    heat = HeatTracker()
    return load_policy(policy)(TierInfo("t", 0, capacity, True), heat), heat


def store(pol, heat, keys, parent_of=None):
    """Records one request over `keys` and stores them all, as the cache would."""
    parent_of = parent_of or {}
    heat.tick()
    for k in reversed(keys):
        heat.touch(k, parent_of.get(k))
    for k in keys:
        pol.on_insert(k, 1)
    for k in reversed(keys):
        pol.on_hit(k)


@pytest.mark.parametrize("policy", POLICIES)
def test_is_a_placement_policy_named_after_its_entry_point(policy):
    pol, _ = make(policy)
    assert isinstance(pol, PlacementPolicy)
    assert pol.name == policy


@pytest.mark.parametrize("policy", POLICIES)
def test_victim_is_resident_and_evictable(policy):
    pol, heat = make(policy)
    keys = [bytes([i]) * 8 for i in range(8)]
    for k in keys:
        store(pol, heat, [k])
    allowed = set(keys[3:6])
    for _ in range(3):
        v = pol.victim(lambda k: k in allowed)
        assert v in allowed
        pol.on_remove(v)
        allowed.discard(v)
    assert pol.victim(lambda k: k in allowed) is None  # nothing evictable left
    assert pol.victim(lambda k: False) is None


@pytest.mark.parametrize("policy", POLICIES)
def test_removed_block_is_never_offered_again(policy):
    pol, heat = make(policy)
    keys = [bytes([i]) * 8 for i in range(6)]
    for k in keys:
        store(pol, heat, [k])
    gone = {keys[0], keys[2], keys[4]}
    for k in gone:
        pol.on_remove(k)
    pol.on_remove(keys[0])  # twice is harmless
    seen = set()
    while (v := pol.victim(lambda k: k not in seen)) is not None:
        assert v not in gone
        seen.add(v)
        pol.on_remove(v)
    assert seen == set(keys) - gone


@pytest.mark.parametrize("policy", POLICIES)
def test_a_parent_is_offered_only_when_the_cache_allows_it(policy):
    pol, heat = make(policy)
    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    store(pol, heat, [a, b, c], {b: a, c: b})
    resident = {a, b, c}
    children = {a: b, b: c}

    def leaf(k):
        return children.get(k) not in resident

    order = []
    while (v := pol.victim(lambda k: k in resident and leaf(k))) is not None:
        order.append(v)
        resident.discard(v)
        pol.on_remove(v)
    assert order == [c, b, a]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("why", list(Admission))
def test_admit_answers_a_bool(policy, why):
    pol, heat = make(policy, capacity=2)
    store(pol, heat, [b"x" * 8, b"y" * 8])
    heat.tick()
    heat.touch(b"z" * 8)
    assert type(pol.admit(b"z" * 8, why)) is bool


def workload(seed, n=300):
    rnd = random.Random(seed)
    convs = [[rnd.randrange(1 << 40) for _ in range(rnd.randint(1, 6))] for _ in range(25)]
    out = []
    for i in range(n):
        conv = rnd.choice(convs)
        if rnd.random() < 0.5:
            conv.append(rnd.randrange(1 << 40))  # the conversation goes on
        ids = conv[:rnd.randint(1, len(conv))]
        out.append(TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids)))
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tiers", [(7,), (6, 11)])
def test_capacity_is_never_exceeded_in_a_replay(policy, tiers):
    placement = make_placement([TierSpec(f"t{i}", c) for i, c in enumerate(tiers)], load_policy(policy),
                               heat=HeatTracker())
    replay = TraceReplay(placement, CostModel(block_bytes=1))
    reqs = workload(len(tiers))
    for req, nu in zip(reqs, next_uses(reqs)):
        keys = [block_key(h) for h in req.hash_ids]
        served = replay.run_request(keys, req.block_tokens(), nu)
        # Hit blocks stay cached through their request: where they were, or
        # promoted to a faster tier.
        where_now = placement.locate(keys)[:len(served)]
        assert all(w is not None and w <= s for w, s in zip(where_now, served))
        if len(tiers) == 1:
            assert where_now == served
        for t in range(placement.tier_count):
            assert placement.used_bytes(t) <= placement.capacity_bytes(t)
            assert placement.blocks(t) <= tiers[t]
        # every block of the request that is cached has its whole prefix cached
        where = placement.locate(keys)
        if None in where:
            assert all(w is None for w in where[where.index(None):])
    assert replay.result.hits > 0
