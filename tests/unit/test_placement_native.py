"""The native placement core against the Python path: every decision, step by step.

Each policy with a native twin replays the same generated workload through
`make_placement(..., engine="python")` and `make_placement(...,
engine="native")`: requests over a prefix forest (shared prefixes, branches, continuations), stored per
block and as runs, hits promoted, pins and holds, reclaims, removals,
adapter-named evictions and restored blocks; every plan, every placed flag
and, after each request, every tier's contents and counters must agree.
"""
import random

import pytest

from ucm.errors import ArgumentError
from ucm.placement import Decision, Op, Step, TierSpec, make_placement
from ucm.placement.engine import PythonPlacement
from ucm.placement.heat import INF, HeatTracker
from ucm.placement.native import NativePlacement
from ucm.placement.policies.base import load_policy, load_policy_class, policy_names

ENGINES = ("python", "native")
# Every installed policy whose class declares a native twin.
NATIVE = [n for n in policy_names() if load_policy_class(n).__dict__.get("native")]


def key(i):
    return i.to_bytes(16, "little")


def workload(seed, n):
    """Requests as key lists over a forest of documents that grow and branch."""
    rnd = random.Random(seed)
    docs = [[key(d * 1000 + i) for i in range(rnd.randint(1, 6))] for d in range(20)]
    fresh = [10 ** 6]
    out = []
    for _ in range(n):
        doc = rnd.choice(docs)
        r = rnd.random()
        if r < 0.3:
            fresh[0] += 1
            doc.append(key(fresh[0]))  # the conversation goes on
        elif r < 0.4:
            cut = rnd.randint(1, len(doc))
            branch = doc[:cut]
            for _ in range(rnd.randint(1, 4)):
                fresh[0] += 1
                branch.append(key(fresh[0]))
            docs.append(branch)  # a new branch off a shared prefix
            doc = branch
        out.append(doc[:rnd.randint(1, len(doc))])
    return out


def state(p):
    return [(p.counters(t), sorted(p.resident_keys(t)), p.used_bytes(t), p.blocks(t))
            for t in range(p.tier_count)]


class Pair:
    """Both engines, driven alike; every answer compared."""

    def __init__(self, policy, tiers, landing=0, history=400):
        specs = [TierSpec(f"t{i}", c) for i, c in enumerate(tiers)]
        self.py = make_placement(specs, load_policy(policy), HeatTracker(50, history_blocks=history),
                                 landing=landing, engine="python")
        self.nat = make_placement(specs, load_policy(policy), HeatTracker(50, history_blocks=history),
                                  landing=landing, engine="native")
        assert type(self.py) is PythonPlacement and type(self.nat) is NativePlacement
        self.links = [set(), set()]
        self.refused = 0  # inserts (or runs) that stopped at a block not placed
        for i, p in enumerate((self.py, self.nat)):
            p.watch(self.links[i].add, self.links[i].discard)

    def call(self, name, *args, **kwargs):
        a = getattr(self.py, name)(*args, **kwargs)
        b = getattr(self.nat, name)(*args, **kwargs)
        assert a == b, f"{name}{args}: python {a} != native {b}"
        if name == "insert" and not a.placed or name == "insert_run" and a.stop < len(args[0]):
            self.refused += 1
        return a

    def check(self):
        assert state(self.py) == state(self.nat)
        assert self.links[0] == self.links[1]
        assert self.py.heat.now == self.nat.heat.now


def drive(pair, reqs, seed, sizes=(1, 2, 3), nexts=None, finish=0.1):
    """`nexts`: per request, the next use of each of its blocks (as a trace
    replay passes them to `record_request`); none by default. `finish`: the
    share of requests that report their output length."""
    rnd = random.Random(seed)
    pinned = []
    for step, keys in enumerate(reqs):
        size = rnd.choice(sizes)
        if nexts is None:
            pair.call("record_request", keys)
        else:
            pair.call("record_request", keys, nexts[step])
        hit = pair.call("lookup", keys)
        pair.call("locate", keys)
        for k in keys[:hit]:
            if rnd.random() < 0.5:
                pair.call("promote", k, force=rnd.random() < 0.2)
        parent = keys[hit - 1] if hit else None
        if rnd.random() < 0.5:
            pair.call("insert_run", keys[hit:], parent, [size] * (len(keys) - hit))
        else:
            for k in keys[hit:]:
                if not pair.call("insert", k, parent, size).placed:
                    break
                parent = k
        pair.call("touch", keys)
        r = rnd.random()
        cached = [k for k in keys if pair.py.contains(k)]
        if r < 0.08 and cached:
            ks = rnd.sample(cached, min(2, len(cached)))
            pair.call("pin", ks)
            pinned.append(ks)
        elif r < 0.14 and pinned:
            pair.call("unpin", pinned.pop(0))
        elif r < 0.18 and cached:
            k = rnd.choice(cached)
            pair.call("hold", [k])
            pair.call("insert", key(5 * 10 ** 6 + step), k, size)
            pair.call("unhold", [k])
        elif r < 0.22 and cached:
            k = rnd.choice(cached)
            pair.call("remove", k, rnd.choice([None] + pair.py.tiers_of(k)))
        elif r < 0.27:
            t = rnd.randrange(pair.py.tier_count)
            pair.call("reclaim", t, rnd.randint(1, 4), rnd.randint(1, 3))
        elif r < 0.33:
            t = rnd.randrange(pair.py.tier_count)
            res = sorted(pair.py.resident_keys(t))
            if res:
                named = rnd.sample(res, min(3, len(res)))
                protect = rnd.choice([None, named[0]])
                relaxed = rnd.random() < 0.5
                pair.call("may_evict", t, named[:1], protect=protect, relaxed=relaxed)
                pair.call("evict_keys", t, named, any_one=True, protect=protect, relaxed=relaxed)
                pair.call("evict_keys", t, named[-1:], protect=None, relaxed=relaxed)
        elif r < 0.36:
            pair.call("insert", key(7 * 10 ** 6 + step), None, size, tier=pair.py.tier_count - 1, restored=True)
        if rnd.random() < finish:
            pair.call("finish_request", keys, rnd.choice([10, 500]))
        for k in keys:
            pair.call("where", k)
            pair.call("tiers_of", k)
            pair.call("size_of", k)
            pair.call("parent_of", k)
            pair.call("contains", k)
        pair.check()


@pytest.mark.parametrize("policy", NATIVE)
@pytest.mark.parametrize("tiers", [(9,), (6, 14), (4, 7, 12)])
@pytest.mark.parametrize("seed", [1, 2])
def test_native_core_makes_every_decision_of_the_python_path(policy, tiers, seed):
    pair = Pair(policy, tiers)
    drive(pair, workload(seed, 300), seed)
    assert any(pair.py.counters(t).evictions for t in range(pair.py.tier_count)), "the tiers churned"


@pytest.mark.parametrize("policy", NATIVE)
def test_same_decisions_with_a_landing_tier_below_the_top(policy):
    pair = Pair(policy, (5, 8, 20), landing=1)
    drive(pair, workload(3, 200), 3)


@pytest.mark.parametrize("policy", NATIVE)
def test_same_decisions_when_history_forgets_parents(policy):
    specs = [TierSpec("dram", 6), TierSpec("nvme", 12)]
    pair = Pair(policy, (6, 12))
    for i, p in enumerate((pair.py, pair.nat)):  # a tiny history: parents are forgotten while resident
        heat = HeatTracker(50, history_blocks=8)
        new = make_placement(specs, load_policy(policy), heat, engine=ENGINES[i])
        new.watch(pair.links[i].add, pair.links[i].discard)
        if i:
            pair.nat = new
        else:
            pair.py = new
    pair.links[0].clear()
    pair.links[1].clear()
    drive(pair, workload(4, 250), 4)


def oracle(reqs):
    """Per request, the next use of each of its blocks, as the trace replay
    computes it (ucm/bench/cache/replay.py `next_uses`): the clock of the next
    request holding the block, INF if none; request i runs at clock i + 1
    (one `record_request` each, from a fresh tracker)."""
    out, seen = [None] * len(reqs), {}
    for i in range(len(reqs) - 1, -1, -1):
        out[i] = [seen.get(k, INF) for k in reqs[i]]
        for k in reqs[i]:
            seen[k] = float(i + 1)
    return out


def wrong_oracle(reqs, seed):
    """Next uses that need not come true: due before the block is used
    again, in the past, repeated, or never (refreshes that change nothing,
    or find a next use already due)."""
    rnd = random.Random(seed)
    return [[rnd.choice([INF, float(i + 1 + rnd.randint(-3, 12)), float(rnd.randint(1, 40))]) for _ in keys]
            for i, keys in enumerate(reqs)]


@pytest.mark.parametrize("tiers", [(9,), (6, 14), (4, 7, 12)])
@pytest.mark.parametrize("seed", [1, 2, 5])
def test_opt_makes_every_decision_of_the_python_path_with_next_uses(tiers, seed):
    reqs = workload(seed, 400)
    pair = Pair("opt", tiers)
    drive(pair, reqs, seed, nexts=oracle(reqs))
    assert any(pair.py.counters(t).evictions for t in range(pair.py.tier_count)), "the tiers churned"
    assert pair.refused, "a full lowest tier refused blocks used later than every resident one"


def test_opt_same_decisions_across_rebuilds_of_its_heaps(monkeypatch):
    from ucm.placement.policies.opt import OptPolicy

    rebuilds = []  # (in _sync?) per rebuild of the Python policy's heaps
    push, sync = OptPolicy._push, OptPolicy._sync

    def counting_push(self, key, nu):
        far = self._far
        push(self, key, nu)
        if self._far is not far:
            rebuilds.append(getattr(self, "_syncing", False))

    def flagged_sync(self):
        self._syncing = True
        try:
            sync(self)
        finally:
            self._syncing = False

    monkeypatch.setattr(OptPolicy, "_push", counting_push)
    monkeypatch.setattr(OptPolicy, "_sync", flagged_sync)
    reqs = workload(2, 1000)
    pair = Pair("opt", (3, 8, 40))
    drive(pair, reqs, 2, nexts=oracle(reqs))
    assert True in rebuilds, "a refresh in _sync rebuilt the heaps (it walks on the one it started with)"


@pytest.mark.parametrize("seed", [1, 3])
def test_opt_same_decisions_with_a_wrong_oracle(seed):
    reqs = workload(seed, 400)
    pair = Pair("opt", (6, 14))
    drive(pair, reqs, seed, nexts=wrong_oracle(reqs, seed))
    assert pair.refused and any(pair.py.counters(t).evictions for t in range(pair.py.tier_count))


def test_opt_same_decisions_when_history_forgets_next_uses():
    specs = [TierSpec("dram", 6), TierSpec("nvme", 12)]
    reqs = workload(6, 300)
    pair = Pair("opt", (6, 12))
    for i in range(2):  # a tiny history: resident blocks' next uses are forgotten (INF)
        new = make_placement(specs, load_policy("opt"), HeatTracker(50, history_blocks=10), engine=ENGINES[i])
        new.watch(pair.links[i].add, pair.links[i].discard)
        pair.links[i].clear()
        if i:
            pair.nat = new
        else:
            pair.py = new
    drive(pair, reqs, 6, nexts=oracle(reqs))
    assert pair.refused


def test_opt_refuses_a_block_used_later_than_every_resident_one():
    pair = Pair("opt", (2,))
    a, b, c, d = key(1), key(2), key(3), key(4)
    for k, nu in ((a, 3.0), (b, INF)):
        pair.call("record_request", [k], [nu])
        assert pair.call("insert", k, None, 1).placed
    pair.call("record_request", [c], [4.0])
    assert pair.call("insert", c, None, 1).plan == [Step(Op.DROP, b, 0, None), Step(Op.WRITE, c, None, 0)]
    pair.call("record_request", [d], [INF])
    assert pair.call("insert", d, None, 1) == Decision(False, [])
    pair.check()
    assert sorted(pair.nat.resident_keys(0)) == [a, c]


@pytest.mark.parametrize("tiers, history", [((24, 70), 60), ((10, 30, 90), 90), ((16, 48), 12)])
def test_heat_twin_on_bigger_tiers_with_a_forgetting_history(monkeypatch, tiers, history):
    """A longer run on bigger tiers whose history forgets resident blocks
    (slots reused at once, the model's waiting episodes dropped), with
    output lengths reported often (reclasses): both engines agree, and the
    Python side shows that the paths the twin mirrors were taken."""
    from ucm.placement.policies.heat import HeatPolicy
    from ucm.placement.policies.reuse import ReuseModel

    seen = dict.fromkeys(["refused", "admitted_full", "requeued", "reclassed", "forgot", "forgot_same_tick",
                          "fallback"], 0)
    in_lowest = [False]

    def wrap(cls, name, after):
        orig = getattr(cls, name)

        def method(self, *args):
            out = orig(self, *args)
            after(self, args, out)
            return out
        monkeypatch.setattr(cls, name, method)

    def lowest(orig):
        def method(self, evictable):
            in_lowest[0] = True
            try:
                return orig(self, evictable)
            finally:
                in_lowest[0] = False
        return method

    def admitted(self, args, out):
        if self._sizes and self._used + self._block > self.tier.capacity_bytes:
            seen["refused" if not out else "admitted_full"] += 1

    def requeued(self, args, out):
        seen["requeued"] += in_lowest[0]

    def reclassed(self, args, out):
        seen["reclassed"] += args[0] in self._queues

    def forgot(self, args, out):
        seen["forgot"] += 1
        seen["forgot_same_tick"] += self._heat.last[args[1]] == args[2]

    def fallback(self, args, out):
        seen["fallback"] += out is not None and out in self._queues._parked  # _lowest offers no parked block

    wrap(HeatPolicy, "admit", admitted)
    wrap(HeatPolicy, "_requeue", requeued)
    wrap(HeatPolicy, "on_reclass", reclassed)
    wrap(HeatPolicy, "victim", fallback)
    wrap(ReuseModel, "on_forget", forgot)
    monkeypatch.setattr(HeatPolicy, "_lowest", lowest(HeatPolicy._lowest))

    pair = Pair("heat", tiers, history=history)
    drive(pair, workload(11 + history, 900), 5 + history, finish=0.5)
    counters = [pair.py.counters(t) for t in range(pair.py.tier_count)]
    assert all(c.evictions for c in counters), "every tier churned"
    assert seen["admitted_full"] > 0, seen
    assert seen["requeued"] > 0, seen  # heads accessed through another tier, or reclassed, re-filed
    assert seen["reclassed"] > 0 and seen["forgot"] > 0, seen
    if history > 12:
        assert seen["refused"] > 0, seen  # admission judged by value, refused too
        assert seen["fallback"] > 0, seen  # only parked parents left: LeafQueues.fallback
    else:
        assert seen["forgot_same_tick"] > 0, seen  # requests longer than the history
    assert pair.py.heat.now == len(workload(11 + history, 900))


def test_the_shipped_policies_have_native_twins():
    from ucm import _native

    assert set(NATIVE) >= {"lru", "fifo", "lfu", "arc", "s3fifo", "opt"}


    assert set(NATIVE) >= {"lru", "fifo", "lfu", "arc", "s3fifo", "heat"}
    assert set(NATIVE) <= set(_native.placement_policies())


def test_policies_without_a_native_twin_stay_on_the_python_path():
    from ucm.placement.policies.base import BoundPolicy
    from ucm.placement.policies.classic import LruPolicy

    class Mine(LruPolicy):
        name = "mine"

    for bound in (BoundPolicy("mine", Mine, {}),):
        assert type(make_placement([TierSpec("dram", 4)], bound, HeatTracker())) is PythonPlacement
        with pytest.raises(ArgumentError, match="no native twin"):
            make_placement([TierSpec("dram", 4)], bound, HeatTracker(), engine="native")
    # A factory that is not a BoundPolicy (a third-party callable) runs in Python too.
    factory = load_policy("lru")
    p = make_placement([TierSpec("dram", 4)], lambda tier, heat: factory(tier, heat))
    assert type(p) is PythonPlacement


def test_a_subclass_does_not_inherit_the_native_twin():
    from ucm.placement.policies.base import BoundPolicy
    from ucm.placement.policies.classic import LruPolicy

    class Mine(LruPolicy):
        name = "mine"

    assert BoundPolicy("mine", Mine, {}).native is None
    assert BoundPolicy("lru", LruPolicy, {}).native == "lru"


def test_more_tiers_than_the_core_takes_keep_the_python_path():
    specs = [TierSpec(f"t{i}", 4) for i in range(9)]
    assert type(make_placement(specs, load_policy("lru"))) is PythonPlacement
    with pytest.raises(ArgumentError, match="at most 8"):
        make_placement(specs, load_policy("lru"), engine="native")
    assert type(make_placement(specs[:8], load_policy("lru"))) is NativePlacement


def test_a_tracker_with_history_keeps_the_python_path():
    heat = HeatTracker()
    heat.tick()
    heat.touch(key(1))
    assert type(make_placement([TierSpec("dram", 4)], load_policy("lru"), heat)) is PythonPlacement


def test_plans_are_steps_of_the_python_types():
    p = make_placement([TierSpec("dram", 2), TierSpec("nvme", 4)], load_policy("lru"))
    a, b, c = key(1), key(2), key(3)
    p.record_request([a, b, c])
    d = p.insert_run([a, b, c], None, [1, 1, 1])
    assert d.placed == [True, True, True] and d.stop == 3
    assert all(type(s) is Step for s in d.plan)
    # c's parent b stays (protected), so a, a parent, is demoted ahead of its child.
    assert d.plan == [Step(Op.WRITE, a, None, 0), Step(Op.WRITE, b, None, 0), Step(Op.MOVE, a, 0, 1),
                      Step(Op.WRITE, c, None, 0)]
    assert p.where(c) == 0 and p.tiers_of(a) == [1]
    assert p.parent_of(b) == a and p.size_of(c) == 1 and p.size_of(key(9)) is None
    with pytest.raises(ArgumentError, match="size_bytes must be > 0"):
        p.insert(key(4), c, 0)
    with pytest.raises(ArgumentError, match="2 keys but 1 sizes"):
        p.insert_run([key(4), key(5)], c, [1])
    with pytest.raises(IndexError):
        p.used_bytes(2)


def test_long_and_short_keys_round_trip():
    p = make_placement([TierSpec("dram", 10)], load_policy("lru"))
    keys = [b"", b"a", b"x" * 16, b"y" * 17, b"z" * 40]
    p.record_request(keys)
    d = p.insert_run(keys, None, [1] * len(keys))
    assert d.placed == [True] * len(keys)
    assert sorted(p.resident_keys(0)) == sorted(keys)
    assert [p.parent_of(k) for k in keys] == [None] + keys[:-1]


def tinylfu_workload(seed, n):
    """Longer requests for tinylfu on bigger tiers: the forest of `workload`,
    hot documents asked again and again (their sketch counters saturate), and
    scans of one-shot prompts; keys of 16 bytes, of 5 (zero-padded in the
    sketch) and of 24 (interned by the core; only the first 16 bytes reach the
    sketch, so pairs that differ after them collide there)."""
    rnd = random.Random(seed)
    forest = workload(seed, n)
    hot = [[key(9 * 10 ** 6 + 10 * d + i) for i in range(rnd.randint(2, 4))] for d in range(4)]
    scan = iter(range(8 * 10 ** 6, 9 * 10 ** 6))
    out = []
    for req in forest:
        r = rnd.random()
        if r < 0.25:
            req = rnd.choice(hot)
        elif r < 0.4:
            req = [key(next(scan)) for _ in range(rnd.randint(2, 6))]
        out.append(req)

    def reshape(k):
        i = int.from_bytes(k, "little")
        if i % 5 == 1:
            return (i % 2 ** 40).to_bytes(5, "little")
        if i % 5 == 2:
            return k + bytes([i % 7, 1]) * 4  # 24 bytes; i and i' with one first 16 share slots
        return k

    return [[reshape(k) for k in req] for req in out]


def test_tinylfu_sketch_window_climb_and_segments_match_on_bigger_tiers(monkeypatch):
    """The paths of tinylfu that small tiers barely reach, each counted on the
    Python path (the native one must make the same decisions): the sketch's
    halving and saturated counters, the window's share climbing both ways and
    deciding the window's size, the window -> probation contest won and lost,
    a move to main with ancestors still in the window, protected overflow."""
    from ucm.placement.policies import tinylfu

    seen = {k: 0 for k in ("halving", "saturated", "flip", "share_target", "contest_won", "contest_lost",
                           "ancestors", "overflow", "long_key", "short_key")}
    Sketch, Policy = tinylfu.FrequencySketch, tinylfu.TinyLfuPolicy
    add, count, target, estimate, victim, move, to_main = (
        Sketch.add, Policy._count, Policy._window_target, Policy._estimate, Policy.victim, Policy._move,
        Policy._to_main)

    def add_(self, k):
        before = self._added
        add(self, k)
        seen["halving"] += self._added <= before
        seen["saturated"] += self.estimate(k) == tinylfu.COUNTER_MAX
        seen["long_key"] += len(k) > 16
        seen["short_key"] += len(k) < 16

    def count_(self, hit):
        step = self._step
        count(self, hit)
        seen["flip"] += (step < 0) != (self._step < 0)

    def target_(self):
        seen["share_target"] += self._window_share * self.tier.capacity_bytes > self._block
        return target(self)

    def estimate_(self, k):
        self._asked.append(k)
        return estimate(self, k)

    def victim_(self, evictable):
        self._asked = []
        found = victim(self, evictable)
        if len(self._asked) == 2:
            seen["contest_lost" if found == self._asked[0] else "contest_won"] += 1
        return found

    def move_(self, k, seg):
        seen["overflow"] += seg == tinylfu.PROBATION and self._queues.queue_of(k) == tinylfu.PROTECTED
        move(self, k, seg)

    def to_main_(self, k):
        p = self.heat.parent(k)
        seen["ancestors"] += p is not None and self._queues.queue_of(p) == tinylfu.WINDOW
        to_main(self, k)

    for cls, name, f in ((Sketch, "add", add_), (Policy, "_count", count_), (Policy, "_window_target", target_),
                         (Policy, "_estimate", estimate_), (Policy, "victim", victim_), (Policy, "_move", move_),
                         (Policy, "_to_main", to_main_)):
        monkeypatch.setattr(cls, name, f)
    for tiers, seed in (((90, 260), 11), ((40, 120, 400), 12)):
        pair = Pair("tinylfu", tiers)
        drive(pair, tinylfu_workload(seed, 1500), seed)
    assert all(seen.values()), seen


@pytest.mark.parametrize("policy", NATIVE)
def test_parent_links_that_form_a_cycle_end_every_walk(policy):
    """Requests [a, b] then [b, a] leave the tracker with a's parent b and
    b's parent a (review: tinylfu's walk to the main area looped forever on
    both engines); every policy stays finite and the engines agree."""
    pair = Pair(policy, (10,))
    a, b = key(1), key(2)
    pair.call("record_request", [a, b])
    pair.call("insert_run", [a, b], None, [1, 1])
    pair.call("record_request", [b, a])
    pair.call("touch", [b, a])
    for i in range(30):
        k = key(100 + i)
        pair.call("record_request", [k], parent=k)  # a block recorded as its own parent
        pair.call("insert", k, None, 1)
        pair.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_next_uses_of_the_wrong_length_or_nan_are_refused_before_anything_is_recorded(engine):
    p = make_placement([TierSpec("dram", 4)], load_policy("opt"), HeatTracker(), engine=engine)
    a, b = key(1), key(2)
    with pytest.raises(ArgumentError, match="2 keys but 3 next uses"):
        p.record_request([a, b], next_uses=[1.0, 2.0, 3.0])
    with pytest.raises(ArgumentError, match="2 keys but 1 next uses"):
        p.record_request([a, b], next_uses=[1.0])
    with pytest.raises(ArgumentError, match="NaN"):
        p.record_request([a, b], next_uses=[1.0, float("nan")])
    assert p.heat.now == 0 and len(p.heat) == 0
    p.record_request([a, b], next_uses=[3.0, float("inf")])
    assert p.heat.now == 1 and p.heat.next_use(a) == 3.0
