"""Block summaries read from a block's bytes through a real KvLayout: Quest's
bound holds in every page and block, the summaries equal those of the keys
themselves (and, for the transformers connector's payload, those computed
from its layer tensors), and their size is what the docstring says."""
import numpy as np
import pytest

from ucm.accelerators.sparse.selectors import quest_bound
from ucm.accelerators.sparse.selectors import SELECTORS, make_selector
from ucm.accelerators.sparse.summaries import (SummaryParts, block_keys, layer_units, store_bounds, summarize,
                                               summarize_keys, summary_nbytes, units_from_keys)
from ucm.codecs.layout import opaque_layout, paged_head_major_layout, planar_layout
from ucm.errors import ArgumentError

LAYERS, HEADS, TOKENS, DIM = 3, 2, 64, 32
DTYPES = ["float32", "float16", "bfloat16"]


def to_dtype(x, dtype):
    """`x` rounded to `dtype`: (the values as float64, their little-endian element bytes)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64), u
    raw = x.astype(np.dtype("<f4" if dtype == "float32" else "<f2"))
    return raw.astype(np.float64), raw


def layouts(dtype):
    return {"planar": planar_layout(dtype, LAYERS, HEADS, TOKENS, DIM),
            "paged": paged_head_major_layout(dtype, LAYERS, HEADS, TOKENS // 16, 16, DIM)}


def pack(keys_raw, values_raw, layout):
    """A block's bytes with `keys_raw` / `values_raw` `[layers, heads,
    tokens, dim]` (element arrays) placed where `layout` says."""
    block = np.zeros(layout.block_bytes, dtype=np.uint8)
    for seg in layout.segments:
        src = keys_raw if seg.kind == "k" else values_raw
        rows = src.reshape(LAYERS, -1, DIM)  # head-major, tokens in order: as row_offsets lists them
        for layer in range(LAYERS):
            for i, off in enumerate(seg.row_offsets()):
                at = layer * layout.layer_bytes + int(off)
                block[at:at + rows.itemsize * DIM] = rows[layer, i].view(np.uint8)
    return block


def random_block(dtype, kind, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((LAYERS, HEADS, TOKENS, DIM)) * rng.uniform(0.5, 4.0)
    k[..., rng.integers(DIM)] += rng.uniform(-20, 20)  # an outlier channel, as real keys have
    keys, keys_raw = to_dtype(k, dtype)
    _, values_raw = to_dtype(rng.standard_normal(k.shape), dtype)
    layout = layouts(dtype)[kind]
    return keys, pack(keys_raw, values_raw, layout), layout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["planar", "paged"])
@pytest.mark.parametrize("seed", range(4))
def test_quest_bound_is_at_least_the_true_max_in_every_page_and_block(dtype, kind, seed):
    keys, block, layout = random_block(dtype, kind, seed)
    summary = summarize(block, layout, page_tokens=16)
    rng = np.random.default_rng(1000 + seed)
    for layer in range(LAYERS):
        for unit in (16, 32, TOKENS):  # a page, two pages, the whole block
            units = layer_units([summary], layer, unit)
            for _ in range(8):
                q = rng.standard_normal((2 * HEADS, DIM)).astype(np.float32) * rng.uniform(0.1, 10)
                bound = quest_bound(q, units.min, units.max).astype(np.float64)  # [q_heads, units]
                qk = np.einsum("hd,htd->ht", q.astype(np.float64), keys[layer][np.arange(2 * HEADS) // 2])
                true_max = qk.reshape(2 * HEADS, -1, unit).max(axis=2)
                # float32 rounding of the bound's sum: far below any gap between a bound and the max
                reach = np.maximum(np.abs(units.min), np.abs(units.max))
                slack = 1e-5 * np.einsum("hd,uhd->hu", np.abs(q), reach[:, np.arange(2 * HEADS) // 2])
                assert (bound >= true_max - slack).all(), (layer, unit, (true_max - bound).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["planar", "paged"])
def test_summaries_read_through_the_layout_equal_those_of_the_keys(dtype, kind):
    keys, block, layout = random_block(dtype, kind, seed=7)
    np.testing.assert_array_equal(block_keys(block, layout), keys.astype(np.float32))
    got = summarize(bytes(block), layout, page_tokens=16)
    want = keys.reshape(LAYERS, HEADS, TOKENS // 16, 16, DIM)
    low, high = store_bounds(want.min(axis=3), want.max(axis=3))  # the exact bounds, kept as float16 outwards
    np.testing.assert_array_equal(got.page_min, low)
    np.testing.assert_array_equal(got.page_max, high)
    np.testing.assert_allclose(got.page_mean, want.mean(axis=3), rtol=1e-5, atol=1e-5)
    low, high = store_bounds(keys.min(axis=2), keys.max(axis=2))  # rounding commutes with min and max
    np.testing.assert_array_equal(got.block_min, low)
    np.testing.assert_array_equal(got.block_max, high)
    np.testing.assert_allclose(got.block_mean, keys.mean(axis=2), rtol=1e-5, atol=1e-5)
    # whole-block units from page summaries equal whole-block units from the keys
    direct = units_from_keys(keys[1].astype(np.float32), TOKENS)
    via = layer_units([got, got], 1, TOKENS)
    np.testing.assert_array_equal(via.min, np.concatenate([direct.min, direct.min]))
    np.testing.assert_array_equal(via.max, np.concatenate([direct.max, direct.max]))
    np.testing.assert_allclose(via.mean, np.concatenate([direct.mean, direct.mean]), rtol=1e-5, atol=1e-5)


def test_summaries_of_a_transformers_connector_block_equal_those_of_its_tensors():
    torch = pytest.importorskip("torch")
    from ucm.connectors.transformers.kv_copy import byte_view, gather_blocks
    from ucm.connectors.transformers.namespace import BlockLayout

    bt, blocks, start = 32, 3, 5  # blocks start at position 5 (a left-padded row)
    layout = BlockLayout(num_layers=4, num_kv_heads=3, block_tokens=bt, head_dim=16, dtype="bfloat16")
    g = torch.Generator().manual_seed(3)
    seq = start + blocks * bt + 2
    ks = [torch.randn(2, 3, seq, 16, generator=g).mul(3).to(torch.bfloat16) for _ in range(4)]
    vs = [torch.randn(2, 3, seq, 16, generator=g).to(torch.bfloat16) for _ in range(4)]
    payload = torch.empty((blocks,) + layout.shape, dtype=torch.bfloat16)
    gather_blocks(ks, vs, row=1, start=start, n_blocks=blocks, block_tokens=bt, out=payload)
    for j in range(blocks):
        got = summarize(byte_view(payload[j].contiguous()), layout.kv_layout(), page_tokens=8)
        for layer, k in enumerate(ks):
            pages = k[1, :, start + j * bt:start + (j + 1) * bt].float().reshape(3, bt // 8, 8, 16)
            np.testing.assert_array_equal(got.page_min[layer], pages.amin(dim=2).numpy())
            np.testing.assert_array_equal(got.page_max[layer], pages.amax(dim=2).numpy())
            np.testing.assert_allclose(got.page_mean[layer], pages.mean(dim=2).numpy(), rtol=1e-6, atol=1e-6)


def test_summary_size_of_a_smollm2_block():
    from ucm.connectors.transformers.namespace import BlockLayout

    layout = BlockLayout(num_layers=30, num_kv_heads=3, block_tokens=128, head_dim=64, dtype="bfloat16")
    assert layout.block_bytes == 2_949_120
    assert summary_nbytes(layout.kv_layout(), 16) == 368_640
    assert summary_nbytes(layout.kv_layout(), 128) == 46_080
    keys = np.zeros((30, 3, 128, 64), dtype=np.float32)
    assert summarize_keys(keys, 16).nbytes == 368_640
    # what each selector keeps (module docstring): quest the float16 bounds (6.25 % of the block), mean the
    # float32 mean (6.25 %), lowrank only its rank-16 float16 projections (12.5 %), hybrid bounds and
    # projections (18.75 %)
    kv = layout.kv_layout()
    bounds, mean, none = SummaryParts(True, False), SummaryParts(False, True), SummaryParts(False, False)
    assert summary_nbytes(kv, 16, parts=bounds) == 184_320 == layout.block_bytes // 16
    assert summary_nbytes(kv, 16, parts=mean) == 184_320
    assert summary_nbytes(kv, 16, 16, none) == 368_640
    assert summary_nbytes(kv, 16, 16, bounds) == 184_320 + 368_640 == layout.block_bytes * 3 // 16
    assert summary_nbytes(kv, 16, 16) == 368_640 + 368_640


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_summaries_keep_the_parts_their_selector_reads_and_count_only_those(name):
    sel = make_selector(name)
    parts = SummaryParts.of(sel)
    assert parts == SummaryParts(bounds=name in ("quest", "moment", "blend", "hybrid"),
                                 mean=name in ("mean", "moment", "blend"))
    keys, block, layout = random_block("float32", "planar", 7)
    got = summarize(block, layout, 16, parts=parts)
    assert (got.page_min is not None, got.page_max is not None, got.page_mean is not None) == \
        (parts.bounds, parts.bounds, parts.mean)
    assert got.nbytes == summary_nbytes(layout, 16, parts=parts) and got.keeps(parts)
    assert got.keeps(SummaryParts(False, False)) and got.keeps(SummaryParts()) == (parts == SummaryParts())
    full = summarize(block, layout, 16)
    if parts.bounds:
        np.testing.assert_array_equal(got.page_min, full.page_min)
        np.testing.assert_array_equal(got.block_max, full.block_max)
    else:
        assert got.block_min is None and got.block_max is None
    # the units a selector is handed hold a part only when every block keeps it
    u = layer_units([full, got], 1, 16)
    assert (u.min is None, u.mean is None) == (not parts.bounds, not parts.mean) and u.units == 2 * TOKENS // 16
    assert layer_units([full, full], 1, 16).min is not None


@pytest.mark.parametrize("name,missing", [("quest", "bounds"), ("moment", "mean"), ("blend", "bounds"),
                                          ("mean", "mean"), ("hybrid", "bounds")])
def test_a_selector_refuses_summaries_without_the_part_it_reads(name, missing):
    from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig, UnitSummaries

    keys, _, _ = random_block("float32", "planar", 8)
    u = units_from_keys(keys[0].astype(np.float32), 16)
    lacking = UnitSummaries(16, u.units, None if missing == "bounds" else u.min, None if missing == "bounds" else u.max,
                            None if missing == "mean" else u.mean)
    query = np.ones((HEADS * 3, DIM), dtype=np.float32)
    step = LayerStep(query, TOKENS, 16, HEADS, summaries=lacking)
    word = "key bounds" if missing == "bounds" else "mean key"
    with pytest.raises(ArgumentError, match=f"selector '{name}' needs summaries that keep the {word}"):
        make_selector(name).select(step, SelectionConfig(Budget.tokens(16), 16, 16))
    with pytest.raises(ArgumentError, match="has 3 units, not 4"):
        UnitSummaries(16, 4, u.min[:3], u.max, u.mean)


def test_unreadable_layouts_and_bad_page_sizes_are_refused():
    with pytest.raises(ArgumentError, match="dtypes"):
        summarize(bytes(64), opaque_layout(64))
    layout = planar_layout("float16", 1, 1, 16, 4)
    with pytest.raises(ArgumentError, match="page_tokens"):
        summarize(bytes(layout.block_bytes), layout, page_tokens=5)
    with pytest.raises(ArgumentError, match="bytes"):
        summarize(bytes(layout.block_bytes - 2), layout)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no overflow warning at float16's limits either
def test_bounds_are_kept_as_float16_rounded_outwards():
    """Every kept min is at or below its float32 min and every kept max at or
    above, by less than one float16 step; values float16 holds exactly are
    kept exactly; beyond its finite range they are clamped to it, never an
    inf (a zero query channel times an inf bound would be NaN)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * rng.choice([1e-6, 1e-3, 1.0, 300.0, 1e4], 20000)).astype(np.float32)
    low, high = store_bounds(x, x)
    assert low.dtype == high.dtype == np.float16
    lo, hi = low.astype(np.float32), high.astype(np.float32)
    assert (lo <= x).all() and (hi >= x).all()
    step = np.spacing(np.abs(x).astype(np.float16)).astype(np.float32)
    assert (x - lo <= step).all() and (hi - x <= step).all()
    exact = x.astype(np.float16).astype(np.float32) == x
    assert exact.sum() > 0 and (lo[exact] == x[exact]).all() and (hi[exact] == x[exact]).all()
    big = np.array([-1e6, -70000.0, 70000.0, 1e6], dtype=np.float32)
    low, high = store_bounds(big, big)
    assert np.isfinite(low).all() and np.isfinite(high).all()
    assert low.tolist() == high.tolist() == [-65504.0, -65504.0, 65504.0, 65504.0]
    q = np.zeros((1, 4), dtype=np.float32)  # a query with a zero channel against the clamped bounds: a number
    assert np.isfinite(quest_bound(q, low.reshape(1, 1, 4).astype(np.float32),
                                   high.reshape(1, 1, 4).astype(np.float32))).all()
