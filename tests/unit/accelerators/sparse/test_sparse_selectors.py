"""Every selector, pages and whole blocks: a full budget selects every
token, fixed budgets are taken exactly, sink and local are always kept; the
oracle's recall is 1 at full budget and no selector beats it at a budget;
top-p takes the fewest units that reach p; Quest finds a planted key that
only one KV head's query group can see; `moment` is exact on constant
units, estimates a normal unit's log attention mass within 0.25 (where
mean and Quest are off by 0.5 and 5), and ranks a spread unit above a
tight one of the same mean; `blend` is quest's and moment's scores mixed
by its weight and ranks by the heads' summed scores (the product of their
masses), so a unit every head rates fairly beats one only one head is sure
of; `hybrid` gives its share of every budget to quest's best and the rest
to lowrank's, so it keeps a needle outside lowrank's directions."""
import numpy as np
import pytest

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.lowrank import fit_key_basis
from ucm.accelerators.sparse.mass import recall, token_mass
from ucm.accelerators.sparse.selectors import (SELECTORS, blend_score, expected_range, interleaved_rank,
                                               make_selector, mean_score, moment_score, quest_bound)
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.errors import ArgumentError, ConfigError

KV_HEADS, GROUP, DIM = 3, 3, 16
N = 1000  # 62 full 16-token pages and a tail of 8 tokens; 7 full 128-token blocks and a tail of 104


def step(unit, seed=0, n=N, keys=None, query=None, rank=4):
    """Summaries with the units' keys projected on a rank-`rank` basis fitted on the keys (for lowrank)."""
    rng = np.random.default_rng(seed)
    if keys is None:
        keys = (rng.standard_normal((KV_HEADS, n, DIM)) * 2).astype(np.float32)
    if query is None:
        query = (rng.standard_normal((KV_HEADS * GROUP, DIM)) * 2).astype(np.float32)
    basis = fit_key_basis([keys], rank).vectors[0]
    return LayerStep(query=query, n_tokens=n, unit_tokens=unit, kv_heads=KV_HEADS,
                     summaries=units_from_keys(keys, unit, basis), keys=keys)


def config(budget, sink=64, local=128):
    return SelectionConfig(budget=budget, sink_tokens=sink, local_tokens=local)


def check_ranges(sel):
    at = 0
    for a, b in sel.ranges:
        assert at <= a < b <= sel.n_tokens
        at = b + 1  # disjoint and merged: the next starts after a gap
    assert sel.tokens == sel.kept_tokens + sel.extra_tokens == int(sel.mask().sum())


NAMES = sorted(SELECTORS)
UNITS = [16, 128]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("budget", [Budget.tokens(N), Budget.ratio(1.0), Budget.top_p(1.0)], ids=str)
def test_a_full_budget_selects_every_token(name, unit, budget):
    sel = make_selector(name).select(step(unit), config(budget))
    assert sel.ranges == ((0, N),)
    check_ranges(sel)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("unit", UNITS)
def test_fixed_budgets_are_taken_exactly(name, unit):
    s = step(unit)
    cands = sum(1 for u in range(N // unit) if u * unit >= 64 and (u + 1) * unit <= N - 128)
    sel0 = make_selector(name).select(s, config(Budget.tokens(0)))
    assert sel0.kept_tokens == N - cands * unit
    for tokens in (0, 1, unit - 1, unit, 3 * unit + 5, 256, 512, N):
        sel = make_selector(name).select(s, config(Budget.tokens(tokens)))
        assert sel.extra_tokens == min(tokens // unit, cands) * unit
        assert sel.kept_tokens == sel0.kept_tokens
        check_ranges(sel)
    for ratio in (0.0, 0.1, 0.25, 0.5):
        sel = make_selector(name).select(s, config(Budget.ratio(ratio)))
        assert sel.extra_tokens == min(int(ratio * N) // unit, cands) * unit
        check_ranges(sel)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("budget", [Budget.tokens(0), Budget.tokens(256), Budget.ratio(0.2), Budget.top_p(0.3)],
                         ids=str)
@pytest.mark.parametrize("sink,local", [(64, 128), (1, 1), (0, 300), (100, 0)])
def test_sink_local_and_tail_are_always_kept(name, unit, budget, sink, local):
    sel = make_selector(name).select(step(unit, seed=2), config(budget, sink, local))
    mask = sel.mask()
    assert mask[:sink].all() and mask[N - local:].all()
    assert mask[(N // unit) * unit:].all()  # the tail: no full unit, no summary
    check_ranges(sel)


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("seed", range(3))
def test_the_oracle_has_recall_one_at_full_budget_and_no_selector_beats_it(unit, seed):
    s = step(unit, seed=seed)
    full = make_selector("oracle").select(s, config(Budget.tokens(N)))
    assert recall(s, full) == pytest.approx(1.0, abs=1e-9)
    for tokens in (0, 128, 256, 512):
        best = recall(s, make_selector("oracle").select(s, config(Budget.tokens(tokens))))
        for name in NAMES:
            got = recall(s, make_selector(name).select(s, config(Budget.tokens(tokens))))
            assert got <= best + 1e-12, (name, tokens)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8, 0.95])
def test_oracle_top_p_takes_the_fewest_units_that_reach_p(p):
    s = step(16, seed=5)
    sel = make_selector("oracle").select(s, config(Budget.top_p(p)))
    mass = token_mass(s.query, s.keys, s.softmax_scale)[:N // 16 * 16].reshape(-1, 16).sum(axis=1)
    free = set(range(N // 16)) - {u for u in range(N // 16) if u * 16 < 64 or (u + 1) * 16 > N - 128}
    total = sum(mass[u] for u in free)
    got = [mass[u] for u in sel.units]
    assert sum(got) >= p * total - 1e-12
    assert sum(got[:-1]) < p * total
    assert got == sorted(got, reverse=True)


@pytest.mark.parametrize("name", ["quest", "mean", "moment", "blend", "oracle"])
@pytest.mark.parametrize("unit", UNITS)
def test_a_key_that_one_query_group_sees_is_selected(name, unit):
    rng = np.random.default_rng(9)
    keys = (rng.standard_normal((KV_HEADS, N, DIM)) * 0.3).astype(np.float32)
    query = np.zeros((KV_HEADS * GROUP, DIM), dtype=np.float32)
    query[GROUP:2 * GROUP, 3] = 4.0  # only the query heads of KV head 1 look along channel 3
    needle = 517  # in page 32 and block 4, far from sink and local
    keys[1, needle - 2:needle + 2, 3] = 6.0
    keys[0, 300:304, 3] = 6.0  # the same key in another KV head, which no query head of group 1 reads
    s = step(unit, keys=keys, query=query)
    sel = make_selector(name).select(s, config(Budget.tokens(unit)))
    assert sel.units == (needle // unit,)


def test_random_is_seeded_and_sinklocal_takes_the_most_recent():
    s = step(16, seed=1)
    c = config(Budget.tokens(160))
    a = make_selector("random", seed=4).select(s, c)
    assert a.ranges == make_selector("random", seed=4).select(s, c).ranges
    assert a.ranges != make_selector("random", seed=5).select(s, c).ranges
    sl = make_selector("sinklocal").select(s, c)
    assert sl.ranges == ((0, 64), (N // 16 * 16 - 8 * 16 - 160, N))


def test_bad_names_budgets_and_steps_are_refused():
    with pytest.raises(ConfigError, match="known"):
        make_selector("nope")
    for bad in (-1, "2", True, 1e9):
        with pytest.raises(ConfigError, match="spread"):
            make_selector("moment", spread=bad)
        with pytest.raises(ConfigError, match="'blend': spread must be a number in \\[0, 100\\]"):
            make_selector("blend", spread=bad)
    for bad in (-0.1, 1.5, "0.5", True, None):
        with pytest.raises(ConfigError, match="'blend': weight must be a number in \\[0, 1\\]"):
            make_selector("blend", weight=bad)
        with pytest.raises(ConfigError, match="'hybrid': quest_share must be a number in \\[0, 1\\]"):
            make_selector("hybrid", quest_share=bad)
    with pytest.raises(ArgumentError):
        Budget.top_p(0.0)
    with pytest.raises(ArgumentError):
        Budget.ratio(1.5)
    with pytest.raises(ArgumentError):
        Budget.tokens(-1)
    with pytest.raises(ArgumentError, match="group"):
        LayerStep(query=np.zeros((4, DIM), np.float32), n_tokens=10, unit_tokens=16, kv_heads=3)
    with pytest.raises(ArgumentError, match="summaries"):
        make_selector("quest").select(LayerStep(query=np.zeros((3, DIM), np.float32), n_tokens=64,
                                                unit_tokens=16, kv_heads=3), config(Budget.tokens(16), 0, 0))


@pytest.mark.parametrize("n", [2, 16, 128])
def test_expected_range_matches_sampled_normals(n):
    x = np.random.default_rng(n).standard_normal((200_000, n))
    assert expected_range(n) == pytest.approx(float((x.max(1) - x.min(1)).mean()), rel=0.01)
    assert expected_range(1) == 0.0


def log_masses(query, keys, unit, scale):
    """Each query head's true log sum exp of its logits over each unit: `[q_heads, units]`."""
    heads, n, dim = keys.shape
    lg = np.einsum("hgd,htd->hgt", query.reshape(heads, -1, dim), keys).reshape(query.shape[0], n // unit, unit)
    lg = lg.astype(np.float64) * scale
    m = lg.max(-1)
    return m + np.log(np.exp(lg - m[..., None]).sum(-1))


@pytest.mark.parametrize("unit", UNITS)
def test_moment_is_exact_on_units_of_equal_keys(unit):
    rng = np.random.default_rng(4)
    per_unit = rng.standard_normal((KV_HEADS, 7, 1, DIM)).astype(np.float32)
    keys = np.ascontiguousarray(np.broadcast_to(per_unit, (KV_HEADS, 7, unit, DIM)).reshape(KV_HEADS, -1, DIM))
    query = rng.standard_normal((KV_HEADS * GROUP, DIM)).astype(np.float32)
    s, scale = units_from_keys(keys, unit), 0.25
    est = np.log(unit) + scale * moment_score(query, s.mean, s.min, s.max, unit, scale)
    np.testing.assert_allclose(est, log_masses(query, keys, unit, scale), atol=1e-5)


@pytest.mark.parametrize("unit,bound", [(16, 0.25), (128, 0.1)])
def test_moment_estimates_the_log_mass_of_normal_units(unit, bound):
    rng = np.random.default_rng(3)
    sigma = rng.uniform(0.2, 1.5, (KV_HEADS, 1, DIM)).astype(np.float32)
    keys = (rng.standard_normal((KV_HEADS, 40 * unit, DIM)) * sigma
            + rng.standard_normal((KV_HEADS, 1, DIM))).astype(np.float32)
    query = rng.standard_normal((KV_HEADS * GROUP, DIM)).astype(np.float32)
    s, scale = units_from_keys(keys, unit), 1 / np.sqrt(DIM)
    true = log_masses(query, keys, unit, scale)
    err = {name: float(np.abs(np.log(unit) + scale * sc - true).mean()) for name, sc in (
        ("moment", moment_score(query, s.mean, s.min, s.max, unit, scale)),
        ("mean", mean_score(query, s.mean)), ("quest", quest_bound(query, s.min, s.max)))}
    assert err["moment"] < bound
    assert err["moment"] * 3 < min(err["mean"], err["quest"]), err


def test_moment_ranks_a_spread_unit_above_a_tight_one_of_the_same_mean():
    rng = np.random.default_rng(6)
    keys = (rng.standard_normal((KV_HEADS, N, DIM)) * 0.05).astype(np.float32)
    query = np.zeros((KV_HEADS * GROUP, DIM), dtype=np.float32)
    query[:, 5] = 3.0
    keys[:, 512:528, 5] = np.tile([2.0, -2.0], 8)  # page 32: mean about 0 along channel 5, wide spread
    s = step(16, keys=keys, query=query)
    assert make_selector("moment").select(s, config(Budget.tokens(16))).units == (32,)
    mean_units = make_selector("mean").select(s, config(Budget.tokens(16))).units
    assert mean_units != (32,)  # the mean key cannot tell it from the rest


def test_blend_mixes_quest_and_moment_by_its_weight():
    rng = np.random.default_rng(11)
    keys = (rng.standard_normal((KV_HEADS, N, DIM)) * rng.uniform(0.2, 2, (KV_HEADS, 1, DIM))).astype(np.float32)
    query = rng.standard_normal((KV_HEADS * GROUP, DIM)).astype(np.float32)
    su, scale = units_from_keys(keys, 16), 0.25
    q, m = quest_bound(query, su.min, su.max), moment_score(query, su.mean, su.min, su.max, 16, scale, 1.5)
    for w in (0.0, 0.3, 1.0):
        np.testing.assert_allclose(blend_score(query, su.mean, su.min, su.max, 16, scale, w), w * q + (1 - w) * m,
                                   rtol=1e-5, atol=1e-5)
    s = step(16, keys=keys, query=query)
    cfg = config(Budget.tokens(160))
    rank = (0.5 * q + 0.5 * m).mean(axis=0)  # the candidates' order: the heads' mean blended score
    cands = [u for u in range(N // 16) if u * 16 >= 64 and (u + 1) * 16 <= N - 128]
    want = tuple(sorted(cands, key=lambda u: -rank[u])[:10])
    assert make_selector("blend").select(s, cfg).units == want


def test_blend_ranks_what_every_head_rates_above_one_heads_pick():
    """Unit 10 is one query head's clear favourite and no other head's;
    unit 40 is every head's second choice. The mean of the heads' masses
    (quest, moment) picks unit 10; blend, adding up the heads' log
    estimates, picks unit 40."""
    keys = np.zeros((1, N, DIM), dtype=np.float32)
    query = np.zeros((3, DIM), dtype=np.float32)
    query[0, 0] = query[1, 1] = query[2, 2] = 4.0
    keys[0, 160:176, 0] = 3.0  # unit 10: head 0 alone, strongly
    keys[0, 640:656, :3] = 1.5  # unit 40: every head, less
    keys[0, 300:316, 1] = 2.0  # unit 18 and 19: heads 1 and 2 each like one more than unit 40
    keys[0, 320:336, 2] = 2.0
    s = LayerStep(query=query, n_tokens=N, unit_tokens=16, kv_heads=1, summaries=units_from_keys(keys, 16),
                  keys=keys)
    cfg = config(Budget.tokens(16))
    assert make_selector("blend").select(s, cfg).units == (40,)
    assert make_selector("quest").select(s, cfg).units == (10,)
    assert make_selector("moment").select(s, cfg).units == (10,)


def best_first(rank, k):
    return set(np.argsort(-rank, kind="stable")[:k].tolist())


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_rank_takes_its_share_from_the_second_ranking(seed):
    rng = np.random.default_rng(seed)
    first, second = rng.standard_normal(200), rng.standard_normal(200)
    assert list(np.argsort(-interleaved_rank(first, second, 0.0))) == list(np.argsort(-first, kind="stable"))
    assert list(np.argsort(-interleaved_rank(first, second, 1.0))) == list(np.argsort(-second, kind="stable"))
    merged = interleaved_rank(first, second, 0.25)
    for k in (4, 20, 64):
        top = best_first(merged, k)
        # every unit of the prefix is among the first's best (1 - share) k or the second's best share k,
        # and each ranking's part reaches at least that far, the units both rank counted once
        a, b = best_first(first, round(0.75 * k)), best_first(second, round(0.25 * k))
        assert a <= top and b <= top
        assert top <= best_first(first, round(0.75 * k) + len(a & b) + 1) | best_first(second, round(0.25 * k) + 1)
    # a unit both rank first is taken once, first
    second[int(np.argmax(first))] = 99.0
    assert int(np.argmax(interleaved_rank(first, second, 0.5))) == int(np.argmax(first))


def test_hybrid_keeps_a_needle_outside_lowranks_directions():
    """Channel 3 carries almost nothing in the keys the basis is fitted on,
    so the rank-4 basis leaves it out and lowrank cannot see the needle
    there that one query group looks for; quest's bound over every channel
    can, and hybrid keeps quest's best unit next to lowrank's."""
    rng = np.random.default_rng(5)
    scale = np.full(DIM, 1.0, np.float32)
    scale[:4] = 0.05
    keys = (rng.standard_normal((KV_HEADS, N, DIM)) * scale).astype(np.float32)
    basis = fit_key_basis([keys], 4).vectors[0]
    query = (rng.standard_normal((KV_HEADS * GROUP, DIM)) * 0.3).astype(np.float32)
    query[GROUP:2 * GROUP, 3] = 4.0
    needle = 517
    keys[1, needle - 2:needle + 2, 3] = 6.0
    s = LayerStep(query=query, n_tokens=N, unit_tokens=16, kv_heads=KV_HEADS,
                  summaries=units_from_keys(keys, 16, basis), keys=keys)
    cfg = config(Budget.tokens(4 * 16))
    low = make_selector("lowrank").select(s, cfg).units
    assert make_selector("quest").select(s, cfg).units[0] == needle // 16
    assert needle // 16 not in low
    got = make_selector("hybrid").select(s, cfg).units
    assert needle // 16 in got and set(low[:3]) <= set(got)
    assert make_selector("hybrid", quest_share=0.0).select(s, cfg).units == low
    # top-p adds up lowrank's mass in the merged order: at least the units lowrank alone takes
    assert len(make_selector("hybrid").select(s, config(Budget.top_p(0.9))).units) >= \
        len(make_selector("lowrank").select(s, config(Budget.top_p(0.9))).units)
