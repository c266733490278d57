"""Placement.evict_keys / may_evict: evicting the blocks an adapter names
(the DRAM arena emptying an extent of one size class), with the same
demotion and parent/child rules as any eviction."""
from importlib.metadata import entry_points

import pytest

from ucm.placement import Op, TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy


POLICIES = sorted({ep.name for ep in entry_points(group="ucm.policies")} - {"opt"})


def key(prefix, i):
    return f"{prefix}:{i}".encode().ljust(16, b".")[:16]


def two_tiers(cap0=10, cap1=100, policy="lru"):
    return make_placement([TierSpec("dram", cap0), TierSpec("nvme", cap1)], load_policy(policy), HeatTracker(50))


def store(p, keys, tier=0):
    p.record_request(keys)
    for i, k in enumerate(keys):
        assert p.insert(k, keys[i - 1] if i else None, 1, tier=tier).placed


def test_a_group_is_demoted_children_first():
    p = two_tiers()
    a = [key("a", i) for i in range(4)]
    store(p, a)
    group = [a[2], a[3]]  # a chain's tail: a3 is a2's only child
    assert p.may_evict(0, group) and not p.may_evict(0, [a[2]])  # a2's child a3 would go after it
    plan = p.evict_keys(0, [a[2], a[3]])
    assert [(s.op, s.key, s.src, s.dst) for s in plan] == [(Op.MOVE, a[3], 0, 1), (Op.MOVE, a[2], 0, 1)]
    assert p.locate(a) == [0, 0, 1, 1] and p.used_bytes(0) == 2


def test_pinned_protected_or_absent_blocks_stop_the_whole_group():
    p = two_tiers()
    a = [key("a", i) for i in range(3)]
    store(p, a)
    p.pin([a[2]])
    assert not p.may_evict(0, [a[1], a[2]]) and p.evict_keys(0, [a[1], a[2]]) == []
    p.unpin([a[2]])
    assert p.evict_keys(0, [a[1], a[2]], protect=a[1]) == []
    assert p.evict_keys(0, [a[2], key("x", 0)]) == []  # not resident there: the group cannot empty
    assert p.locate(a) == [0, 0, 0]


def test_relaxed_demotes_a_parent_whose_children_stay():
    p = two_tiers()
    a = [key("a", i) for i in range(3)]
    store(p, a)
    assert not p.may_evict(0, [a[1]]) and p.may_evict(0, [a[1]], relaxed=True)
    plan = p.evict_keys(0, [a[1]], relaxed=True)
    assert [(s.op, s.key) for s in plan] == [(Op.MOVE, a[1])]
    assert p.locate(a) == [0, 1, 0]  # the prefix stays cached below its child


def test_any_one_lets_the_policy_pick_among_the_named():
    p = two_tiers()
    a, b = [key("a", i) for i in range(3)], [key("b", i) for i in range(3)]
    store(p, a)
    store(p, b)
    p.record_request(a)
    p.touch(a)  # a is now more recent than b
    plan = p.evict_keys(0, [a[2], b[2], b[1]], any_one=True)
    assert [(s.op, s.key) for s in plan] == [(Op.MOVE, b[2])]  # the least recent leaf of the named
    assert p.evict_keys(0, [a[1]], any_one=True) == []  # a parent: only when relaxed
    assert [s.key for s in p.evict_keys(0, [a[1]], any_one=True, relaxed=True)] == [a[1]]


def test_in_the_lowest_tier_a_parent_leaves_only_with_its_children():
    p = make_placement([TierSpec("dram", 10)], load_policy("lru"), HeatTracker(50))
    a = [key("a", i) for i in range(3)]
    store(p, a)
    assert not p.may_evict(0, [a[1]], relaxed=True)  # a2 would be orphaned
    assert p.may_evict(0, [a[1], a[2]])
    plan = p.evict_keys(0, [a[1], a[2]], relaxed=True)
    assert [(s.op, s.key) for s in plan] == [(Op.DROP, a[2]), (Op.DROP, a[1])]
    assert p.lookup(a) == 1 and p.used_bytes(0) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_keeps_its_books(policy):
    p = two_tiers(policy=policy)
    a = [key("a", i) for i in range(6)]
    store(p, a)
    p.evict_keys(0, a[3:])
    where = p.locate(a)
    assert where[:3] == [0, 0, 0] and 0 not in where[3:]
    assert where[:p.lookup(a)] == [w for w in where if w is not None]  # what is cached is a prefix
    assert p.used_bytes(0) == 3 and p.used_bytes(1) == p.lookup(a) - 3
    store(p, [key("b", 0)])  # the policy still works after the named evictions
    assert p.locate([key("b", 0)]) == [0]
