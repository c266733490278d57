"""Low-rank keys (ucm/accelerators/sparse/lowrank.py) and the `lowrank`
selector: the fitted basis is orthonormal and the same for the same keys;
its projections are what the summaries keep (from a block's bytes, of the
size `summary_nbytes` says) and reach the selector only when every block
was projected with the basis asked for; at full rank, or on keys that lie
in the basis's span, lowrank picks exactly what the oracle picks; without
projections it refuses rather than guess."""
import numpy as np
import pytest

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.index import SummaryIndex
from ucm.accelerators.sparse.lowrank import KeyBasis, fit_key_basis, lowrank_mass, store_projections
from ucm.accelerators.sparse.mass import token_mass
from ucm.accelerators.sparse.selectors import make_selector
from ucm.accelerators.sparse.summaries import layer_units, summarize, summarize_keys, summary_nbytes, units_from_keys
from ucm.codecs.layout import planar_layout
from ucm.errors import ArgumentError

KV_HEADS, GROUP, DIM = 3, 3, 16
N = 1024  # 64 pages of 16, 8 blocks of 128: no tail


def keys_and_query(seed=0, n=N):
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((KV_HEADS, n, DIM)) * rng.uniform(0.2, 3.0, DIM)).astype(np.float32)
    query = (rng.standard_normal((KV_HEADS * GROUP, DIM)) * 2).astype(np.float32)
    return keys, query


def test_the_basis_is_orthonormal_and_the_same_for_the_same_keys():
    keys, _ = keys_and_query()
    b = fit_key_basis([keys, 2 * keys], 5)
    assert b.vectors.shape == (2, KV_HEADS, DIM, 5) and b.vectors.dtype == np.float32 and b.rank == 5
    gram = np.einsum("lhdr,lhds->lhrs", b.vectors, b.vectors)
    assert np.abs(gram - np.eye(5)).max() < 1e-5
    again = fit_key_basis([keys.copy(), 2 * keys], 5)
    assert np.array_equal(again.vectors, b.vectors) and again.digest == b.digest
    assert fit_key_basis([keys, 2 * keys], 4).digest != b.digest
    # the leading direction is the keys' largest: keys scaled along channel 0 put it there
    stretched = keys.copy()
    stretched[:, :, 0] *= 50
    lead = fit_key_basis([stretched], 1).vectors[0, :, :, 0]
    assert np.all(lead[:, 0] > 0.99)  # and positive: the sign rule


def test_bad_ranks_and_keys_are_refused():
    keys, _ = keys_and_query(n=8)
    for rank in (0, -1, True, 2.0):
        with pytest.raises(ArgumentError, match="rank must be an int > 0"):
            fit_key_basis([keys], rank)
    with pytest.raises(ArgumentError, match="cannot give rank 9"):
        fit_key_basis([keys], 9)  # 8 tokens
    with pytest.raises(ArgumentError, match="no keys"):
        fit_key_basis([], 2)
    with pytest.raises(ArgumentError, match="float32"):
        KeyBasis(np.zeros((1, 3, 16, 2), dtype=np.float64))
    with pytest.raises(ArgumentError, match="do not match the basis"):
        fit_key_basis([keys], 2).project(np.zeros((1, 2, 4, DIM), dtype=np.float32))


def test_at_full_rank_the_mass_is_the_true_mass():
    keys, query = keys_and_query(1)
    b = fit_key_basis([keys], DIM)
    proj = b.project(keys[None])[0]
    got = lowrank_mass(query, b.vectors[0], proj, 0.25)
    assert np.abs(got - token_mass(query, keys, 0.25)).max() < 1e-6 and got.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("unit", [16, 128])
@pytest.mark.parametrize("how", ["full rank", "keys in a rank-3 span"])
def test_lowrank_picks_what_the_oracle_picks_when_the_projections_are_exact(unit, how):
    keys, query = keys_and_query(2)
    rank = DIM
    if how != "full rank":
        rng = np.random.default_rng(3)
        span = np.linalg.qr(rng.standard_normal((DIM, 3)))[0].astype(np.float32)  # [DIM, 3] orthonormal
        keys = (rng.standard_normal((KV_HEADS, N, 3)).astype(np.float32) * 3) @ span.T
        rank = 3
    basis = fit_key_basis([keys], rank).vectors[0]
    s = LayerStep(query=query, n_tokens=N, unit_tokens=unit, kv_heads=KV_HEADS,
                  summaries=units_from_keys(keys, unit, basis), keys=keys)
    for budget in (Budget.tokens(128), Budget.tokens(384), Budget.top_p(0.7)):
        cfg = SelectionConfig(budget, 64, 128)
        assert make_selector("lowrank").select(s, cfg).units == make_selector("oracle").select(s, cfg).units


def test_lowrank_finds_single_hot_tokens_a_page_mean_dilutes():
    # one token in each of three pages has a key along the query: lowrank sees the token (as the oracle
    # does), the page mean dilutes it below a page of middling keys
    rng = np.random.default_rng(4)
    keys = (rng.standard_normal((KV_HEADS, N, DIM)) * 0.5).astype(np.float32)
    query = np.zeros((KV_HEADS * GROUP, DIM), dtype=np.float32)
    query[:, 2] = 3.0
    hot = [300, 517, 700]
    keys[:, hot, 2] = 6.0  # exp(6 x 3 / 4) = 90 per hot page
    keys[:, 400:416, 2] = 0.8  # 16 x exp(0.8 x 3 / 4) = 29, a higher mean than any hot page's
    s = LayerStep(query=query, n_tokens=N, unit_tokens=16, kv_heads=KV_HEADS,
                  summaries=units_from_keys(keys, 16, fit_key_basis([keys], 2).vectors[0]), keys=keys)
    cfg = SelectionConfig(Budget.tokens(48), 64, 128)
    want = {t // 16 for t in hot}
    assert set(make_selector("lowrank").select(s, cfg).units) == want
    assert set(make_selector("oracle").select(s, cfg).units) == want
    assert 400 // 16 in make_selector("mean").select(s, cfg).units


def test_without_projections_lowrank_refuses():
    keys, query = keys_and_query()
    s = LayerStep(query=query, n_tokens=N, unit_tokens=16, kv_heads=KV_HEADS, summaries=units_from_keys(keys, 16))
    with pytest.raises(ArgumentError, match="needs summaries made with a KeyBasis"):
        make_selector("lowrank").select(s, SelectionConfig(Budget.tokens(64), 64, 128))


def test_summaries_keep_the_projections_of_a_blocks_bytes_and_count_them():
    layers, heads, tokens, dim = 2, 2, 64, 32
    layout = planar_layout("float32", layers, heads, tokens, dim)
    rng = np.random.default_rng(5)
    kv = rng.standard_normal((layers, 2, heads, tokens, dim)).astype(np.float32)
    keys = kv[:, 0]
    basis = fit_key_basis(list(keys), 4)
    s = summarize(kv.tobytes(), layout, 16, basis)
    assert s.projected_with(basis) and not s.projected_with(None)
    # kept as float16: each projection within float16's rounding (2^-11 relative) of the exact one
    assert s.proj.dtype == np.float16
    np.testing.assert_allclose(s.proj.astype(np.float32), np.einsum("lhtd,lhdr->lhtr", keys, basis.vectors),
                               rtol=2.0 ** -10, atol=1e-6)
    assert s.nbytes == summary_nbytes(layout, 16, 4) == summary_nbytes(layout, 16) + layers * heads * tokens * 4 * 2
    plain = summarize(kv.tobytes(), layout, 16)
    assert plain.proj is None and plain.nbytes == summary_nbytes(layout, 16)
    index = SummaryIndex(10 * s.nbytes, 16)
    index.add(b"k", kv.tobytes(), layout, basis)
    assert index.used_bytes == s.nbytes and index.get(b"k").projected_with(basis)


def test_layer_units_hand_over_projections_only_made_with_the_basis_asked_for():
    rng = np.random.default_rng(6)
    blocks_keys = [rng.standard_normal((2, KV_HEADS, 128, DIM)).astype(np.float32) for _ in range(3)]
    basis = fit_key_basis([np.concatenate([b[l] for b in blocks_keys], axis=1) for l in range(2)], 4)
    other = fit_key_basis([b[0] for b in blocks_keys[:1]] * 2, 4)
    summaries = [summarize_keys(k, 16, basis) for k in blocks_keys]
    u = layer_units(summaries, 1, 16, basis)
    whole = np.concatenate([k[1] for k in blocks_keys], axis=1)  # [kv_heads, 384, DIM]
    assert u.proj.shape == (KV_HEADS, 384, 4) and u.proj.dtype == np.float32
    assert np.array_equal(u.basis, basis.vectors[1])
    np.testing.assert_allclose(u.proj, np.einsum("htd,hdr->htr", whole, basis.vectors[1]), rtol=2.0 ** -10, atol=1e-6)
    assert layer_units(summaries, 1, 16).proj is None  # not asked for
    assert layer_units(summaries, 1, 16, other).proj is None  # made with another basis
    mixed = summaries[:2] + [summarize_keys(blocks_keys[2], 16)]
    assert layer_units(mixed, 1, 16, basis).proj is None  # one block without


def test_projections_are_kept_as_float16_and_a_key_beyond_its_range_stays_finite():
    x = np.array([1.0, -3.14159, 7e4, -1e9, 65504.0], dtype=np.float32)
    got = store_projections(x)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    assert got.tolist() == [1.0, np.float16(-3.14159), 65504.0, -65504.0, 65504.0]
    # a block whose key is far along the basis: summarised, scored, and picked, never a NaN mass
    keys, _ = keys_and_query(9)
    basis = fit_key_basis([keys], 4)
    lead = basis.vectors[0, :, :, 0]  # [kv_heads, DIM]: each head's first direction
    keys[:, 700, :] = lead * 1e6
    s = summarize_keys(keys[None], 16, basis)
    assert np.isfinite(s.proj).all() and np.abs(s.proj).max() == 65504.0
    units = layer_units([s], 0, 16, basis)  # one 1,024-token "block"
    query = np.repeat(lead, GROUP, axis=0) * 2  # every query head along its KV head's first direction
    step = LayerStep(query=query, n_tokens=N, unit_tokens=16, kv_heads=KV_HEADS, summaries=units)
    sel = make_selector("lowrank").select(step, SelectionConfig(Budget.tokens(16), 64, 128))
    assert sel.units == (700 // 16,)
