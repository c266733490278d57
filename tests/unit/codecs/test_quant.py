"""int8 / int4: every element within half its tile's step of the original
(plus the rounding to the KV dtype), outliers exact, the encoded size the
documented formula, and bytes that do not decode refused."""
import numpy as np
import pytest
import torch

from ucm.codecs.frame import HEADER_BYTES, frame_bytes
from ucm.codecs.layout import paged_head_major_layout, planar_layout
from ucm.codecs.quant import Int4Codec, Int8Codec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Relative rounding of a value written back in the dtype (half an ulp).
ROUND = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -23}


def kv_like(n_elems, dtype, seed):
    """Gaussian values with per-channel offsets and scales and a few spikes,
    like real keys (64 channels innermost)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_elems // 64, 64, generator=g) * torch.linspace(0.05, 4.0, 64) + torch.linspace(-2, 2, 64)
    flat = x.reshape(-1)
    spikes = torch.randint(0, flat.numel(), (max(1, n_elems // 5000),), generator=g)
    flat[spikes] = 60.0
    return flat.to(DTYPES[dtype])


def segments(layout, t):
    """K and V of every layer as [heads * tokens, channels] float tensors,
    in the codec's table order (through the layout's row offsets)."""
    eb = layout.elem_bytes
    rows = layout.block_rows()
    out, at = [], 0
    for _ in range(layout.num_layers):
        for s in layout.segments:
            offs = rows[at:at + s.rows]
            at += s.rows
            idx = (offs[:, None] // eb + np.arange(s.channels)[None, :])
            out.append(t.float().numpy()[idx])
    return out


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("codec_cls", [Int8Codec, Int4Codec])
@pytest.mark.parametrize("which", ["vllm-cpu", "planar"])
def test_every_element_is_within_half_its_tile_step(codec_cls, dtype, which):
    layout = (paged_head_major_layout(dtype, 3, 2, 4, 32, 64) if which == "vllm-cpu"
              else planar_layout(dtype, 3, 2, 128, 64))
    x = kv_like(layout.block_bytes // layout.elem_bytes, dtype, seed=len(dtype))
    codec = codec_cls()
    enc = codec.encode(memoryview(x.view(torch.uint8).numpy()), layout)
    assert enc is not None
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out.view(torch.uint8).numpy()))
    steps = codec.tile_steps(memoryview(enc.meta), memoryview(enc.body))
    table = codec._plan(layout, codec.params(layout)).table
    orig, back = segments(layout, x), segments(layout, out)
    assert len(orig) == len(steps) == 2 * layout.num_layers
    exact = 0
    for a, b, st, row in zip(orig, back, steps, table):
        rows, cols, tr, tc = (int(v) for v in row[:4])
        step = np.repeat(np.repeat(st.reshape(rows // tr, cols // tc), tr, axis=0), tc, axis=1)
        bound = step / 2 * (1 + 1e-5) + np.abs(a) * ROUND[dtype] * 2 + 1e-30
        err = np.abs(a - b)
        ok = err <= bound
        if codec.bits == 8:
            assert ok.all(), (err - bound).max()
        else:  # the outliers are exact; all others within the bound
            assert ok.sum() >= ok.size - int(row[5]) and (err[~ok] == 0).all()
            exact += int(row[5])
        assert not np.allclose(a, b, rtol=0, atol=0) or codec.bits == 8  # int4 changes values
    assert (out.float().abs().max() >= 59.0)  # the spikes survive (int8: scaled; int4: kept exact)


def test_a_spike_in_the_values_is_kept_exact_by_int4():
    layout = planar_layout("bfloat16", 1, 1, 32, 64)
    x = torch.zeros(layout.block_bytes // 2, dtype=torch.bfloat16)
    x[:] = torch.linspace(-1, 1, x.numel()).to(torch.bfloat16)
    spike = 2048 + 100  # in V (K is the layer's first 32 x 64 elements)
    x[spike] = 1232.0  # representable in bf16
    codec = Int4Codec()
    enc = codec.encode(memoryview(x.view(torch.uint8).numpy()), layout)
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out.view(torch.uint8).numpy()))
    assert out[spike].item() == 1232.0
    # Without the spike in it, its group keeps the step of its neighbours (range 0.97 / 15: error <= 0.034).
    err = (out.float() - x.float()).abs()
    assert err[2048:][torch.arange(2048) != 100].max() < 0.034


def key_widths(body, row, n_tiles):
    """The widths (1-8) of a paired key segment's pairs of tiles, from its bytes."""
    at = int(row[7]) + 4 + 2 * n_tiles
    nib = np.frombuffer(bytes(body[at:at + (n_tiles // 2 + 1) // 2]), np.uint8)
    return (np.stack([nib & 0x0F, nib >> 4], 1).reshape(-1)[:n_tiles // 2] + 1).astype(int)


def test_int4_gives_key_bits_where_the_queries_look():
    """Keys: a width per RoPE pair (c, c + D/2) of each 32-token tile, 4 per
    tile on average; a pair with large keys and a wide range (where a query
    is large too, and feels the error) gets more bits and a finer step than
    a quiet pair of the same range, which gets fewer."""
    layout = planar_layout("float32", 1, 1, 64, 64)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(64, 64, generator=g) * 0.5
    k[:, 5] += 20.0  # pair 5: channels 5 and 37, large keys
    k[:, 37] += 20.0
    x = torch.cat([k.reshape(-1), torch.randn(64 * 64, generator=g)])
    codec = Int4Codec()
    enc = codec.encode(memoryview(x.numpy().view(np.uint8)), layout)
    plan = codec._plan(layout, codec.params(layout))
    krow = plan.table[0]
    assert int(krow[8]) == 1 and int(krow[5]) == 0  # keys paired, no key outliers; values not paired
    assert int(plan.table[1][8]) == 0 and int(plan.table[1][5]) > 0
    w = key_widths(enc.body, krow, 2 * 64).reshape(2, 32)  # [token group, pair]
    assert w.sum() == 4 * 2 * 32 and w.min() >= 1 and w.max() <= 8
    assert (w[:, 5] > 4).all() and (w[:, 5] >= w.max(1)).all()
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out.numpy().view(np.uint8)))
    err = (out[:4096] - x[:4096]).abs().reshape(64, 64)
    assert err[:, [5, 37]].max() < err[:, [6, 38]].max()  # finer where the bits went
    steps = codec.tile_steps(memoryview(enc.meta), memoryview(enc.body))[0].reshape(2, 64)
    assert (err.reshape(2, 32, 64) <= torch.tensor(steps)[:, None, :] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_int4_steps_span_each_tile_with_all_16_levels(dtype):
    """Each tile's step is the smallest code (2^(-1/16) apart) at or above
    (max - min) / 15 of its non-outlier elements (or |min| / 127, for the
    zero point's range): 16 levels over the tile's range, not 15."""
    layout = planar_layout(dtype, 2, 3, 128, 64)
    x = kv_like(layout.block_bytes // layout.elem_bytes, dtype, seed=11)
    codec = Int4Codec()
    enc = codec.encode(memoryview(x.view(torch.uint8).numpy()), layout)
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out.view(torch.uint8).numpy()))
    steps = codec.tile_steps(memoryview(enc.meta), memoryview(enc.body))
    table = codec._plan(layout, codec.params(layout)).table
    checked = 0
    body = np.frombuffer(bytes(enc.body), np.uint8)
    for a, st, row in zip(segments(layout, x), steps, table):
        rows, cols, tr, tc, _, n_out, _, at, paired = (int(v) for v in row)
        grid = st.reshape(rows // tr, cols // tc)
        # The outliers' u16 indexes follow the f32 base, the 2-byte tile
        # parameters and (keys) the widths' nibbles.
        widths = key_widths(body, row, grid.size).reshape(rows // tr, cols // 2) if paired else None
        start = at + 4 + 2 * grid.size + ((grid.size // 2 + 1) // 2 if paired else 0)
        out_idx = body[start:start + 2 * n_out].view("<u2")
        inlier = np.ones(a.shape, bool)
        inlier.reshape(-1)[out_idx] = False
        for i in range(rows // tr):
            for j in range(cols // tc):
                t = a[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
                kept = t[inlier[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]]
                if kept.size < 2:
                    continue
                w = int(widths[i, j % (cols // 2)]) if paired else 4
                f = 2 ** (w - 4) if w > 4 else 1
                levels = 2 ** w - 1 + (0.5 - f if w > 4 else 0)
                need = max((kept.max() - kept.min()) / levels, abs(kept.min()) / (127 * f))
                assert need * (1 - 1e-6) <= grid[i, j] <= need * 2 ** (1 / 16) * (1 + 1e-6), (i, j)
                checked += 1
    assert checked > 1000


def test_encoded_size_is_the_documented_formula():
    smollm2 = paged_head_major_layout("bfloat16", 30, 3, 1, 128, 64)
    assert smollm2.block_bytes == 2_949_120 and len(smollm2.to_bytes()) == 126
    # int8: per segment n = 3 * 128 * 64 = 24,576 int8 + 2 bytes per tile (K: 3 x 64 channels, V: 3 x 128 tokens)
    n = 24_576
    int8_body = 30 * ((2 * 192 + n) + (2 * 384 + n))
    assert Int8Codec().encoded_bytes(smollm2) == 48 + 126 + 20 + int8_body == 1_509_314
    # int4: 4 (base) + 2 per tile (K: 3 x 64 x 128/32, V: 3 x 128 x 64/32) + n / 2;
    # K: a nibble per pair of tiles (768 / 4 bytes), V: 49 outliers (2 per
    # mille of n) x (u16 index + bf16 value)
    int4_k = 4 + 2 * 768 + 768 // 4 + n // 2
    int4_v = 4 + 2 * 768 + 49 * (2 + 2) + n // 2
    # int4's parameters are 24 bytes (the sink flag after int8's five u32s).
    assert Int4Codec().encoded_bytes(smollm2) == 48 + 126 + 24 + 30 * (int4_k + int4_v) == 841_518
    assert smollm2.block_bytes / 841_518 > 3.5 and smollm2.block_bytes / 1_509_314 > 1.9
    # A block whose sink token is kept: value tiles over 64 channels (384
    # per segment, not 768: 1,536 bytes fewer per layer) pay for 30 x 2 x 3
    # rows of 64 bf16 values (23,040 bytes): the same size.
    int4_v_sink = 4 + 2 * 384 + 49 * (2 + 2) + n // 2
    assert Int4Codec().encoded_bytes(smollm2, sink=True) == (48 + 126 + 24 + 30 * (int4_k + int4_v_sink)
                                                             + 30 * 2 * 3 * 64 * 2) == 841_518
    # A segment of more than 65,536 elements indexes its outliers with u32s:
    # n = 8 x 128 x 128 = 131,072, 262 outliers, 8 x 128 x 4 + 8 x 128 x 4 tiles.
    big = planar_layout("float16", 1, 8, 128, 128)
    big_n = 131_072
    big_k = 4 + 2 * 4096 + 4096 // 4 + big_n // 2
    big_v = 4 + 2 * 4096 + 262 * (4 + 2) + big_n // 2
    assert Int4Codec().encoded_bytes(big) == 48 + len(big.to_bytes()) + 24 + big_k + big_v
    # The stored frame of a real encode has exactly that size.
    x = kv_like(smollm2.block_bytes // 2, "bfloat16", 3)
    for codec in (Int8Codec(), Int4Codec()):
        enc = codec.encode(memoryview(x.view(torch.uint8).numpy()), smollm2)
        assert frame_bytes(len(enc.meta), len(enc.body)) == codec.encoded_bytes(smollm2)
    xb = kv_like(big.block_bytes // 2, "float16", 4)
    enc = Int4Codec().encode(memoryview(xb.view(torch.uint8).numpy()), big)
    assert frame_bytes(len(enc.meta), len(enc.body)) == Int4Codec().encoded_bytes(big)
    assert HEADER_BYTES == 48


@pytest.mark.parametrize("codec_cls", [Int8Codec, Int4Codec])
def test_what_cannot_be_encoded_is_refused_and_bad_bytes_do_not_decode(codec_cls):
    layout = planar_layout("bfloat16", 2, 1, 32, 64)
    codec = codec_cls()
    x = kv_like(layout.block_bytes // 2, "bfloat16", 5)
    raw = memoryview(x.view(torch.uint8).numpy())
    assert codec.encode(raw, None) is None  # no layout
    assert codec.encode(raw[:-2], layout) is None  # another size
    assert codec.encode(raw, planar_layout("float8_e4m3", 2, 1, 32, 128)) is None  # a dtype not read
    for value in ("nan", "inf", "-inf"):  # in a key segment and in the last value segment
        for at in (7, len(x) - 1):
            bad = x.clone()
            bad[at] = float(value)
            assert codec.encode(memoryview(bad.view(torch.uint8).numpy()), layout) is None, (value, at)
    enc = codec.encode(raw, layout)
    out = memoryview(bytearray(len(raw)))
    assert not codec.decode(memoryview(enc.meta), memoryview(bytes(enc.body)[:-1]), out)  # short body
    assert not codec.decode(memoryview(enc.meta[:-3]), memoryview(enc.body), out)  # bad meta
    assert not codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(bytearray(len(raw) - 2)))


def test_float16_blocks_use_steps_that_are_halves_rounded_up():
    """Golden conversions are pinned in cpp/tests/test_core.cpp; here a
    float16 block decodes within half a step of every value."""
    layout = planar_layout("float16", 1, 1, 2, 2)
    x = torch.tensor([1.0, -0.5, 0.25, 0.125, 3.0, -3.0, 0.0, 1e-3], dtype=torch.float16)
    codec = Int8Codec()
    enc = codec.encode(memoryview(x.view(torch.uint8).numpy()), layout)
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out.view(torch.uint8).numpy()))
    steps = codec.tile_steps(memoryview(enc.meta), memoryview(enc.body))
    # K per channel over 2 tokens: tiles (1.0, 0.25) and (-0.5, 0.125); each step is the smallest half >= amax / 127.
    for st, amax in zip(steps[0], (1.0, 0.5)):
        half = np.float16(st)
        assert float(half) == st and st >= np.float32(amax) / np.float32(127)
        assert float(np.nextafter(half, np.float16(0))) < np.float32(amax) / np.float32(127)
    err = np.abs(out.float().numpy() - x.float().numpy())
    assert (err[:4] <= np.tile(steps[0], 2) / 2 + 2 ** -11).all()


def test_int4_outliers_of_values_near_the_float_limit_stay_in_bounds():
    """A tile of values near FLT_MAX of both signs (tile 2 x 2, as the native
    API allows): float sums overflowed to +inf and -inf, the tile's mean was
    NaN and the outlier pick ran past its index array (a crash). Run in a
    child so that a crash fails the test instead of the run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import numpy as np
        from ucm import _native
        x = np.array([[3e38, -3e38], [3e38, -3e38]] * 4, np.float32)
        rows, cols = x.shape
        ro = np.arange(rows, dtype=np.int64) * cols * 4
        tab = np.array([[rows, cols, 2, 2, 4, 1, 0, 0, 0]], dtype=np.int64)
        enc = np.zeros(_native.kv_encoded_bytes(rows, cols, 2, 2, 4, 1, 0), np.uint8)
        ok = _native.kv_encode(x.tobytes(), ro, tab, 0, enc, 1)
        if ok:
            out = bytearray(x.nbytes)
            assert _native.kv_decode(enc, tab, 0, out, ro, 1)
        print("ok" if ok else "refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() in ("ok", "refused")
