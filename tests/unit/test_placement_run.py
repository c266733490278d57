"""`Placement.insert_run` and the batched calls decide exactly as the per-block calls."""
import random
from importlib.metadata import entry_points

import pytest

from ucm.errors import ArgumentError
from ucm.placement import Op, RunDecision, Step, TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy

POLICIES = sorted(ep.name for ep in entry_points(group="ucm.policies"))


def key(i):
    return i.to_bytes(16, "little")


def requests(seed, n=150):
    rnd = random.Random(seed)
    docs = [[key(1000 * d + i) for i in range(rnd.randrange(2, 12))] for d in range(20)]
    return [rnd.choice(docs)[:rnd.randrange(1, 12)] for _ in range(n)]


def state(p):
    return [(p.counters(t), sorted(p.resident_keys(t)), p.used_bytes(t)) for t in range(p.tier_count)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tiers", [(9,), (5, 13)])
def test_insert_run_makes_the_decisions_of_one_insert_per_block(policy, tiers):
    runs = []
    for batched in (False, True):
        p = make_placement([TierSpec(f"t{i}", c) for i, c in enumerate(tiers)], load_policy(policy),
                           HeatTracker(50))
        plans = []
        for keys in requests(7):
            p.record_request(keys)
            n = p.lookup(keys)
            parent = keys[n - 1] if n else None
            if batched:
                d = p.insert_run(keys[n:], parent, [1] * (len(keys) - n))
                plans.append(d.plan)
            else:
                plan = []
                for k in keys[n:]:
                    d = p.insert(k, parent, 1)
                    plan += d.plan
                    if not d.placed and not p.contains(k):
                        break
                    parent = k
                plans.append(plan)
            p.touch(keys)
            for t in range(p.tier_count):
                assert p.used_bytes(t) <= p.capacity_bytes(t)
        runs.append((plans, state(p)))
    assert runs[0] == runs[1]


def test_run_decision_flags_each_key_and_stops_at_the_first_refusal():
    p = make_placement([TierSpec("dram", 3)], load_policy("lru"))
    a, b, c, d = (key(i) for i in range(4))
    p.record_request([a, b])
    assert p.insert(a, None, 1).placed
    run = p.insert_run([a, b, c], None, [1, 1, 1])  # a is cached already: skipped, the run goes on
    assert isinstance(run, RunDecision)
    assert run.placed == [False, True, True] and run.stop == 3
    assert [s for s in run.plan] == [Step(Op.WRITE, b, None, 0), Step(Op.WRITE, c, None, 0)]
    p.pin([a, b, c])  # nothing can make room: d is refused, and what would follow is not tried
    run = p.insert_run([d, key(5)], c, [1, 1])
    assert run.placed == [False, False] and run.stop == 0 and run.plan == []
    assert not p.contains(d)


def test_insert_run_checks_its_arguments():
    p = make_placement([TierSpec("dram", 3)], load_policy("lru"))
    with pytest.raises(ArgumentError, match="2 keys but 1 sizes"):
        p.insert_run([key(1), key(2)], None, [1])
    with pytest.raises(ArgumentError, match="size_bytes must be > 0"):
        p.insert_run([key(1)], None, [0])
    assert p.insert_run([], None, []) == RunDecision([], [], 0)


def test_a_run_longer_than_the_landing_tier_demotes_its_own_prefix():
    p = make_placement([TierSpec("dram", 4), TierSpec("nvme", 40)], load_policy("lru"))
    keys = [key(i) for i in range(16)]
    p.record_request(keys)
    run = p.insert_run(keys, None, [1] * 16)
    assert all(run.placed) and run.stop == 16
    assert p.lookup(keys) == 16  # the whole prompt stays cached: its prefix moved down
    assert p.blocks(0) == 4 and p.blocks(1) == 12
    moves = [s for s in run.plan if s.op is Op.MOVE]
    assert len(moves) == 12 and all(s.src == 0 and s.dst == 1 for s in moves)
