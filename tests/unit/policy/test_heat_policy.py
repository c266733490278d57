"""The heat policy, its ReuseModel and LeafQueues."""
import random

import pytest

from ucm.bench.cache.replay import CostModel, TraceReplay
from ucm.placement import TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import Admission, TierInfo, load_policy
from ucm.placement.policies.leafqueue import LeafQueues
from ucm.placement.policies.reuse import NUM_CLASSES, ReuseModel, age_bucket, classify
from ucm.bench.cache.traces import TraceRequest


def hot_and_one_shot(seed=7, n=3000):
    """Half the requests reuse one of 30 hot prompts (plus a fresh question),
    half are one-shot prompts: a small cache thrashes under LRU."""
    rnd = random.Random(seed)
    counter = iter(range(1 << 40))

    def new(k):
        return [next(counter) for _ in range(k)]

    hot = [new(rnd.randint(3, 8)) for _ in range(30)]
    reqs = []
    for i in range(n):
        ids = rnd.choice(hot) + new(1) if rnd.random() < 0.5 else new(rnd.randint(4, 12))
        reqs.append(TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids)))
    return reqs


def two_tier(policy, reqs, dram=40, nvme=120):
    placement = make_placement([TierSpec("dram", dram), TierSpec("nvme", nvme)], load_policy(policy),
                               heat=HeatTracker())
    return TraceReplay(placement, CostModel(block_bytes=1), policy_name=policy).replay(reqs)


def test_heat_writes_fewer_nvme_bytes_than_write_all_at_an_equal_or_better_hit_ratio():
    reqs = hot_and_one_shot()
    lru, heat = two_tier("lru", reqs), two_tier("heat", reqs)
    assert heat.hit_ratio >= lru.hit_ratio
    lru_nvme, heat_nvme = lru.to_dict()["nvme_bytes_written"], heat.to_dict()["nvme_bytes_written"]
    assert heat_nvme < 0.5 * lru_nvme


def test_heat_beats_lru_on_a_single_tier_under_one_shot_pressure():
    reqs = hot_and_one_shot(seed=3)
    results = {}
    for policy in ("lru", "heat"):
        p = make_placement([TierSpec("dram", 60)], load_policy(policy), heat=HeatTracker())
        results[policy] = TraceReplay(p, CostModel(block_bytes=1)).replay(reqs).hit_ratio
    assert results["heat"] > 1.5 * results["lru"]


def test_heat_keeps_recency_when_everything_is_reused_soon():
    """Each prompt comes back after a few requests: nothing is one-shot, so
    heat must not fall behind LRU (it learns that young blocks are hot)."""
    rnd = random.Random(5)
    live, reqs, counter = [], [], iter(range(1 << 40))
    for i in range(2000):
        if live and rnd.random() < 0.8:
            ids = live.pop(rnd.randrange(len(live)))
        else:
            ids = [next(counter) for _ in range(rnd.randint(2, 6))]
        if rnd.random() < 0.9:
            live.append(ids)
        if len(live) > 6:
            live.pop(0)
        reqs.append(TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids)))
    results = {}
    for policy in ("lru", "heat"):
        p = make_placement([TierSpec("dram", 24)], load_policy(policy), heat=HeatTracker())
        results[policy] = TraceReplay(p, CostModel(block_bytes=1)).replay(reqs).hit_ratio
    assert results["heat"] >= 0.97 * results["lru"]


def test_a_full_tier_refuses_what_would_be_the_next_to_go():
    heat = HeatTracker()
    pol = load_policy("heat")(TierInfo("nvme", 1, 4, True), heat)
    model = ReuseModel.of(heat)
    for t in range(1, 400):  # teach the model: reused blocks come back, once-used ones never do
        heat.tick()
        heat.touch(b"hot" + bytes([t % 4]) * 5)
        heat.touch(b"cold" + t.to_bytes(4, "little"))
    assert model.hazard()[classify(2, False)].max() > model.hazard()[classify(1, False)].max()
    for i in range(4):
        pol.on_insert(b"hot" + bytes([i]) * 5, 1)
    heat.tick()
    heat.touch(b"new-cold")
    assert not pol.admit(b"new-cold", Admission.DEMOTE)
    assert pol.admit(b"hot" + bytes([0]) * 5, Admission.DEMOTE)


def test_reuse_model_counts_exposure_and_reuses_per_age():
    heat = HeatTracker()
    model = ReuseModel.of(heat)
    a = b"a" * 8
    heat.tick()  # t=1
    heat.touch(a)  # first (deepest) block of its request: a tail, used once
    for _ in range(4):  # t=2..5; at each tick the block is one tick older
        heat.tick()
    heat.touch(a)  # reused at age 4
    c = classify(1, True)
    assert model.exposure[c, :4].tolist() == [1.0, 2.0, 1.0, 0.0]  # ages 1 | 2,3 | 4
    assert model.events[c, age_bucket(4)] == 1.0
    assert model.events.sum() == 1.0
    assert heat.get(a).count == 2 and heat.tail(a)


def test_reuse_model_forgets_with_the_tracker_history():
    heat = HeatTracker(history_blocks=2)
    model = ReuseModel.of(heat)
    for t in range(5):
        heat.tick()
        heat.touch(bytes([t]) * 8)
    assert model.alive.sum() == 2  # only what the tracker still remembers is waiting


def test_classes_and_age_buckets():
    classes = {classify(n, t, e, o) for n in (1, 2, 9) for t in (False, True) for e in (False, True)
               for o in (False, True)}
    assert len(classes) == NUM_CLASSES
    assert classify(2, False, False, True) != classify(2, False, False, False)
    assert classify(3, False) == classify(50, False) != classify(2, False) != classify(1, False)
    assert classify(1, False, True) != classify(1, False, False)
    assert classify(2, True, True) == classify(2, True, False)  # only a block used once is split


def test_tracker_tells_new_text_behind_a_known_prefix():
    heat = HeatTracker()
    p, a, b, q = b"p" * 8, b"a" * 8, b"b" * 8, b"q" * 8
    heat.tick()  # request 1: p <- a, deepest first as Placement.record_request reports it
    heat.touch(a, parent=p)
    heat.touch(p)
    assert not heat.get(a).ext and not heat.get(p).ext  # p was seen in this request only
    heat.tick()  # request 2: p <- b <- q, the same prefix with new text behind it
    heat.touch(q, parent=b)
    heat.touch(b, parent=p)
    heat.touch(p)
    assert heat.get(b).ext and not heat.get(q).ext  # q's parent b is new too
    assert classify(heat.get(b).count, heat.get(b).tail, heat.get(b).ext) == classify(1, False, True)


def test_reuse_model_learns_each_once_used_kind_apart():
    heat = HeatTracker()
    model = ReuseModel.of(heat)
    root = b"root" * 2
    for t in range(1, 300):  # new documents come back; questions behind a known prefix never do
        heat.tick()
        doc = b"d" + (t // 2).to_bytes(7, "little")  # each document is sent twice, two ticks apart
        heat.touch(b"q" + t.to_bytes(7, "little"), parent=root)
        heat.touch(root)
        heat.tick()
        heat.touch(doc)
    h = model.hazard()
    assert h[classify(1, True, False)].max() > 10 * h[classify(1, True, True)].max()
    assert [age_bucket(a) for a in (0, 1, 2, 3, 4, 7, 8)] == [0, 0, 1, 1, 2, 2, 3]


def test_density_prefers_what_is_reused_soon():
    m = ReuseModel()
    m.events[0, :] = 1.0
    m.exposure[0, :] = 1000.0
    m.events[1, :] = 50.0
    m.exposure[1, :] = 1000.0
    table = m.density(64)
    assert min(table[1]) > max(table[0])


def test_leaf_queues_park_parents_until_their_last_child_leaves():
    heat = HeatTracker()
    a, b, c, d = (bytes([x]) * 8 for x in b"abcd")
    heat.tick()
    for k, p in ((b, a), (c, a), (a, None), (d, None)):
        heat.touch(k, p)
    q = LeafQueues(heat)
    for prio, k in enumerate((a, b, c, d)):
        q.add(k, 0, prio)
    resident = {a, b, c, d}

    def evictable(k):
        return k in resident and not (k == a and (b in resident or c in resident))

    assert q.head(0, evictable) == (1, b)  # a (priority 0) has children: parked
    q.remove(b)
    resident.discard(b)
    assert q.head(0, evictable) == (2, c)
    q.remove(c)
    resident.discard(c)
    assert q.head(0, evictable) == (0, a)  # back when its last child left


def test_leaf_queues_skip_without_parking_what_is_only_pinned():
    heat = HeatTracker()
    x, y = b"x" * 8, b"y" * 8
    q = LeafQueues(heat)
    q.add(x, 0, 1)
    q.add(y, 0, 2)
    assert q.head(0, lambda k: k != x) == (2, y)
    assert q.head(0, lambda k: True) == (1, x)  # not parked: no children


@pytest.mark.parametrize("seed", range(3))
def test_heat_replay_is_deterministic(seed):
    reqs = hot_and_one_shot(seed=seed, n=600)
    assert two_tier("heat", reqs).to_dict() | {"elapsed_s": 0} == \
        two_tier("heat", reqs).to_dict() | {"elapsed_s": 0}


def test_leaf_queues_wake_puts_a_parked_block_back():
    heat = HeatTracker()
    a, b = b"a" * 8, b"b" * 8
    heat.tick()
    heat.touch(b, a)
    heat.touch(a)
    q = LeafQueues(heat)
    q.add(a, 0, 0)
    q.add(b, 0, 1)
    assert q.head(0, lambda k: k == b) == (1, b)  # a parked: it has a child
    q.wake(a)  # the policy now wants to see it (e.g. S3-FIFO moving it on)
    assert q.head(0, lambda k: True) == (0, a)


def test_finish_reclasses_a_waiting_block_and_new_blocks_inherit_the_kind():
    heat = HeatTracker()
    model = ReuseModel.of(heat)
    a, b = b"a" * 8, b"b" * 8
    heat.tick()
    heat.touch(a)
    assert heat.finish([a, b"unknown!"], 500) == [a]  # a long answer; an unknown key is skipped
    assert heat.finish([a], 900) == []  # already long: nothing changes, nothing to re-file
    assert heat.get(a).long_out and heat.get(b"unknown!") is None
    long_once, short_once = classify(1, True, False, True), classify(1, True, False, False)
    assert model.alive[long_once, 0] == 1.0 and model.alive[short_once].sum() == 0.0
    for _ in range(3):  # the waiting episode ages in its new class
        heat.tick()
    assert model.exposure[long_once].sum() == 3.0 and model.exposure[short_once].sum() == 0.0
    heat.touch(b, parent=a)  # a new block behind a: its parent's kind until its request reports
    assert heat.get(b).long_out
    heat.finish([a, b], 20)
    assert not heat.get(a).long_out and not heat.get(b).long_out
    assert model.alive.sum() == 2.0 and model.alive[long_once].sum() == 0.0


def test_reuse_model_learns_which_output_kind_comes_back():
    """Documents that got short answers are sent again; those summarised at
    length never are. Nothing else tells the two apart."""
    heat = HeatTracker()
    model = ReuseModel.of(heat)
    for t in range(1, 400):
        heat.tick()
        doc = b"d" + t.to_bytes(7, "little")
        heat.touch(doc)
        heat.finish([doc], 20 if t % 2 else 900)
        if t > 2 and t % 2:
            heat.tick()
            old = b"d" + (t - 2).to_bytes(7, "little")
            heat.touch(old)
            heat.finish([old], 20)
    h = model.hazard()
    assert h[classify(1, True, False, False)].max() > 10 * h[classify(1, True, False, True)].max()


def summaries_and_queried_documents(seed=11, n=3000):
    """New documents of 6 blocks each: a third get a short answer and are
    asked about once more 30 to 80 requests later; the rest are summarised
    at length and never come back. Sizes and timing say nothing more."""
    rnd = random.Random(seed)
    counter = iter(range(1 << 40))
    again: dict[int, tuple] = {}
    reqs = []
    for i in range(n):
        if i in again:
            ids, out = again.pop(i), 16
        else:
            ids = tuple(next(counter) for _ in range(6))
            out = 600
            if rnd.random() < 1 / 3:
                out = 16
                t = i + rnd.randint(30, 80)
                while t in again:
                    t += 1
                again[t] = ids
        reqs.append(TraceRequest(i + 1, float(i), 512 * len(ids), out, ids))
    return reqs


def test_heat_uses_the_output_length_the_engine_reports():
    reqs = summaries_and_queried_documents()
    blind = [TraceRequest(r.line, r.timestamp_ms, r.input_length, 16, r.hash_ids) for r in reqs]
    ratio = {}
    for name, trace in (("told", reqs), ("blind", blind)):
        p = make_placement([TierSpec("dram", 150)], load_policy("heat"), heat=HeatTracker())
        ratio[name] = TraceReplay(p, CostModel(block_bytes=1)).replay(trace).hit_ratio
    assert ratio["told"] > 1.1 * ratio["blind"]


def learned_model(seed=5, n=3000):
    """A ReuseModel taught by a tracker with a bounded history over reused
    and one-shot prompts, with output kinds reported."""
    rnd = random.Random(seed)
    heat = HeatTracker(history_blocks=300)
    model = ReuseModel.of(heat)
    for req in hot_and_one_shot(seed, n):
        keys = [i.to_bytes(8, "little") for i in req.hash_ids]
        heat.tick()
        heat.touch_request(keys)
        if rnd.random() < 0.3:
            heat.finish(keys, rnd.choice([10, 500]))
    return model


def test_native_tables_agree_with_the_numpy_twins():
    """The hazard and density tables come from ucm._native when it is built
    (both engines then use the same numbers); the numpy code, the fallback
    without it, gives the same tables to rounding."""
    import numpy as np

    from ucm import _native
    from ucm.placement.policies import reuse
    from ucm.placement.policies.reuse import density_table, estimate_hazard

    assert reuse._native is _native  # the model uses the native tables here
    empty = ReuseModel()
    models = [empty, learned_model(5), learned_model(6, 800)]
    skewed = ReuseModel()
    skewed.events[0, :] = 1.0
    skewed.exposure[0, :] = 1000.0
    skewed.events[1, :3] = 50.0
    skewed.exposure[1, :] = 1e9
    models.append(skewed)
    for m in models:
        lam = m.hazard()
        assert np.array_equal(lam, np.array(_native.reuse_hazard(m.events, m.exposure)))
        np.testing.assert_allclose(lam, estimate_hazard(m.events, m.exposure), rtol=1e-12, atol=0)
        for horizon in (0.5, 1, 3.5, 64, 1000.0, 12345.6, 5e5, 3e6):
            native = m.density(horizon)
            assert native == _native.reuse_density(lam, horizon)
            np.testing.assert_allclose(np.array(native), np.array(density_table(lam, horizon)),
                                       rtol=1e-12, atol=0)
    assert np.array(models[1].density(100)).max() > 0  # a learned model values reuse
    with pytest.raises(Exception, match="320 float64"):
        _native.reuse_density(np.zeros((4, 20)), 1.0)


def test_heat_policy_without_the_native_tables(monkeypatch):
    """The numpy fallback drives the policy as before when ucm._native is absent."""
    from ucm.placement.policies import reuse

    reuse_density = reuse.density_table

    def python_path():
        placement = make_placement([TierSpec("dram", 40), TierSpec("nvme", 120)], load_policy("heat"),
                                   heat=HeatTracker(), engine="python")
        return TraceReplay(placement, CostModel(block_bytes=1)).replay(hot_and_one_shot(seed=9, n=800))

    with_native = python_path()
    calls = []
    monkeypatch.setattr(reuse, "density_table", lambda lam, h: calls.append(h) or reuse_density(lam, h))
    monkeypatch.setattr(reuse, "_native", None)
    fallback = python_path()
    assert calls  # the numpy tables were used
    assert fallback.hit_ratio == pytest.approx(with_native.hit_ratio, abs=0.01)
