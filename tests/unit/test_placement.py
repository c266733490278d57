"""Placement invariants under random workloads, for every installed policy."""
import random
from importlib.metadata import entry_points

import pytest

from ucm.placement import Op, TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy

POLICIES = sorted({ep.name for ep in entry_points(group="ucm.policies")} - {"opt"})


def key(prefix, i):
    return f"{prefix}:{i}".encode().ljust(16, b".")[:16]


def check(p, pinned):
    for t in range(p.tier_count):
        assert p.used_bytes(t) <= p.capacity_bytes(t)
        assert p.used_bytes(t) == sum(p.size_of(k) for k in p.resident_keys(t))
        for k in p.resident_keys(t):
            parent = p.parent_of(k)
            assert parent is None or p.contains(parent), "a cached child always has its cached parent"
    for k in pinned:
        assert p.contains(k), "a pinned block is never evicted"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tiers", [(6,), (4, 9)])
def test_random_requests_keep_every_invariant(policy, tiers):
    rnd = random.Random(42)
    p = make_placement([TierSpec(f"t{i}", c) for i, c in enumerate(tiers)], load_policy(policy), HeatTracker(50))
    pinned = set()
    docs = [[key(d, i) for i in range(rnd.randrange(1, 8))] for d in range(12)]
    for step in range(400):
        doc = rnd.choice(docs)
        keys = doc[:rnd.randrange(1, len(doc) + 1)]
        p.record_request(keys)
        hit = p.lookup(keys)
        assert all(p.contains(k) for k in keys[:hit])
        for k in keys[:hit]:
            d = p.promote(k)
            for s in d.plan:
                assert s.op in (Op.MOVE, Op.COPY, Op.DROP)
        for i in range(hit, len(keys)):
            d = p.insert(keys[i], keys[i - 1] if i else None, 1)
            if not d.placed:
                break
        p.touch(keys)
        if step == 100:
            pinned = set(docs[0][:2]) & {k for k in docs[0][:2] if p.contains(k)}
            p.pin(pinned)
        check(p, pinned)


def test_plans_name_every_byte_movement():
    p = make_placement([TierSpec("dram", 2), TierSpec("nvme", 3)], load_policy("lru"))
    a, b, c = key("a", 0), key("a", 1), key("a", 2)
    p.record_request([a, b, c])
    steps = []
    for i, k in enumerate([a, b, c]):
        steps += p.insert(k, [None, a, b][i], 1).plan
    # The third block pushes the oldest evictable block down to NVMe first.
    assert [(s.op, s.key) for s in steps][:2] == [(Op.WRITE, a), (Op.WRITE, b)]
    assert (Op.MOVE, 0, 1) in [(s.op, s.src, s.dst) for s in steps]
    assert steps[-1].op is Op.WRITE and steps[-1].key == c
    assert p.lookup([a, b, c]) == 3


def test_remove_drops_the_orphaned_subtree():
    p = make_placement([TierSpec("dram", 10)], load_policy("lru"))
    ks = [key("r", i) for i in range(4)]
    for i, k in enumerate(ks):
        p.insert(k, ks[i - 1] if i else None, 1)
    plan = p.remove(ks[1])
    assert {s.key for s in plan} == set(ks[2:]) and all(s.op is Op.DROP for s in plan)
    assert p.lookup(ks) == 1 and p.used_bytes(0) == 1


def test_child_without_parent_is_refused_and_pins_hold():
    p = make_placement([TierSpec("dram", 2)], load_policy("lru"))
    a, b, x = key("p", 0), key("p", 1), key("x", 0)
    assert not p.insert(b, a, 1).placed
    assert p.insert(a, None, 1).placed and p.insert(x, None, 1).placed
    p.pin([a, x])
    assert not p.insert(key("y", 0), None, 1).placed  # everything pinned: refused, nothing dropped
    assert p.contains(a) and p.contains(x)
    p.unpin([x])
    assert p.insert(key("y", 0), None, 1).placed and p.contains(a) and not p.contains(x)


def test_reclaim_demotes_victims_until_the_headroom_is_free():
    p = make_placement([TierSpec("dram", 6), TierSpec("nvme", 10)], load_policy("lru"))
    ks = [key("h", i) for i in range(6)]
    p.record_request(ks)
    for i, k in enumerate(ks):
        assert p.insert(k, ks[i - 1] if i else None, 1).placed
    p.pin([ks[5]])
    assert len(p.reclaim(0, 1, max_victims=8)) == 1 and p.used_bytes(0) == 5  # one block's room asked
    plan = p.reclaim(0, 3, max_victims=1)  # a few at a time: one victim per call here
    assert [(s.op, s.src, s.dst) for s in plan] == [(Op.MOVE, 0, 1)]
    plan = p.reclaim(0, 3, max_victims=8)
    assert p.used_bytes(0) == 3 and p.reclaim(0, 3, max_victims=8) == []  # no more than asked
    assert all(s.op is Op.MOVE for s in plan)
    assert p.lookup(ks) == 6 and p.where(ks[5]) == 0  # demoted, not lost; the pinned block stays
    assert p.reclaim(1, 10, max_victims=8) == []  # the lowest tier has nowhere to demote to
    p.pin(ks[:5])
    assert p.reclaim(0, 6, max_victims=8) == []  # nothing evictable: nothing planned


@pytest.mark.parametrize("policy", POLICIES)
def test_a_reader_stages_a_pinned_prefix_longer_than_the_landing_tier(policy):
    """Pins promise a hit: the blocks stay cached, not in a given tier. A
    reader staging its own pinned prefix, block by block, through a landing
    tier smaller than the prefix makes room from the copies it staged
    before (they are still below), so every block can be staged."""
    p = make_placement([TierSpec("dram", 3), TierSpec("nvme", 20)], load_policy(policy), HeatTracker(50))
    ks = [key("doc", i) for i in range(6)]
    p.record_request(ks)
    for i, k in enumerate(ks):
        assert p.insert(k, ks[i - 1] if i else None, 1).placed
    fill = [key("fill", i) for i in range(6)]  # push the document down to nvme
    p.record_request(fill)
    for i, k in enumerate(fill):
        p.insert(k, fill[i - 1] if i else None, 1)
    assert p.locate(ks) == [1] * 6
    p.pin(ks)  # the engine was promised all six
    for k in ks:
        p.hold([k])  # the reader's lease while it copies
        try:
            assert p.where(k) == 0 or p.promote(k, force=True).placed
            assert p.where(k) == 0
        finally:
            p.unhold([k])
        check(p, ks)
    p.hold(ks[-1:])
    assert p.where(ks[-1]) == 0 and p.promote(ks[0], force=True).placed  # the held one stays
    assert p.where(ks[-1]) == 0
    check(p, ks)


def test_a_pinned_block_with_no_other_copy_is_never_a_victim():
    p = make_placement([TierSpec("dram", 2), TierSpec("nvme", 2)], load_policy("lru"), HeatTracker(50))
    a = [key("a", i) for i in range(2)]
    p.record_request(a)
    for i, k in enumerate(a):
        p.insert(k, a[i - 1] if i else None, 1)
    p.pin(a)
    b = [key("b", i) for i in range(4)]
    p.record_request(b)
    for i, k in enumerate(b):
        p.insert(k, b[i - 1] if i else None, 1)
    check(p, a)  # demoted at most (one copy, somewhere), never dropped


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_promotion_is_a_use_of_the_copy_it_reads_and_keeps_it_in_the_lowest_tier(engine):
    # DRAM of 1 block over NVMe of 3, lru: `doc` is demoted first, then used through DRAM
    # (promoted, read from NVMe, its NVMe copy staying) and dropped from DRAM again
    # (free: the NVMe copy is there). The fillers demoted before that use go first.
    p = make_placement([TierSpec("dram", 1), TierSpec("nvme", 3)], load_policy("lru"), engine=engine)
    doc, fillers = key("doc", 0), [key("f", i) for i in range(4)]
    assert p.insert(doc, None, 1).placed
    for f in fillers[:2]:
        assert p.insert(f, None, 1).placed  # doc, then f0 below: nvme holds doc, f0
    d = p.promote(doc, force=True)  # staged back up: f1 demoted; nvme doc, f0, f1
    assert d.placed and [(s.op, s.key) for s in d.plan] == [(Op.MOVE, fillers[1]), (Op.COPY, doc)]
    assert p.insert(fillers[2], None, 1).placed  # doc leaves DRAM by a drop, its NVMe copy stays
    assert p.tiers_of(doc) == [1] and p.used_bytes(1) == 3
    plan = p.insert(fillers[3], None, 1).plan  # f2 demoted into a full NVMe: its lru victim goes
    assert (Op.DROP, fillers[0], 1) in [(s.op, s.key, s.src) for s in plan]
    assert p.tiers_of(doc) == [1] and p.tiers_of(fillers[0]) == []
