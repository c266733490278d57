"""int4 keeps a block's sink token exact: the block is told by its values
(ucm.codecs.sinks), its token-0 rows come back bit for bit, every other
element within half its tile's step, the size is the documented one, and
a frame whose kept rows do not fit its meta does not decode."""
import numpy as np
import pytest
import torch

from ucm.codecs.frame import frame_bytes
from ucm.codecs.layout import paged_head_major_layout, planar_layout
from ucm.codecs.quant import Int4Codec, Int8Codec
from ucm.codecs.sinks import SINK_RATIO, SinkRows

from test_quant import DTYPES, ROUND, kv_like, segments

LAYOUTS = {"vllm-cpu": lambda dt: paged_head_major_layout(dt, 3, 2, 4, 32, 64),
           "planar": lambda dt: planar_layout(dt, 3, 2, 128, 64)}


def with_sink(layout, x, scale=0.1):
    """`x` with token 0's values of every head and layer scaled by `scale`
    (a sink's small values); the element indexes of every token-0 row."""
    x = x.clone()
    rows, eb, at = layout.block_rows(), layout.elem_bytes, 0
    firsts = []
    for _ in range(layout.num_layers):
        for s in layout.segments:
            for h in range(s.heads):
                o = int(rows[at + h * s.tokens]) // eb
                firsts.append(np.arange(o, o + s.channels))
                if s.kind == "v":
                    x[o:o + s.channels] = (x[o:o + s.channels].float() * scale).to(x.dtype)
            at += s.rows
    return x, np.concatenate(firsts)


def raw_of(x):
    return memoryview(x.view(torch.uint8).numpy())


def flag(codec, enc):
    return codec.split_meta(memoryview(enc.meta))[1]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_a_sink_token_comes_back_exact_and_the_rest_within_half_a_step(dtype, which):
    layout = LAYOUTS[which](dtype)
    x, firsts = with_sink(layout, kv_like(layout.block_bytes // layout.elem_bytes, dtype, seed=7))
    codec = Int4Codec()
    assert SinkRows(layout).score(raw_of(x)) < SINK_RATIO
    enc = codec.encode(raw_of(x), layout)
    params = flag(codec, enc)
    assert params[5] == 1 and params[3] == 64  # kept, and value tiles over 64 channels pay for it
    assert frame_bytes(len(enc.meta), len(enc.body)) == codec.encoded_bytes(layout, sink=True)
    out = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), raw_of(out))
    assert torch.equal(out[firsts].view(torch.uint8 if dtype != "float32" else torch.int32),
                       x[firsts].view(torch.uint8 if dtype != "float32" else torch.int32))
    rest = np.ones(len(x), bool)
    rest[firsts] = False
    assert not torch.equal(out[rest], x[rest])  # the others are quantised
    # Every element within half its tile's step (the outliers exact), the kept rows included.
    steps = codec.tile_steps(memoryview(enc.meta), memoryview(enc.body))
    table = codec._plan(layout, params).table
    for a, b, st, row in zip(segments(layout, x), segments(layout, out), steps, table):
        r, c, tr, tc = (int(v) for v in row[:4])
        step = np.repeat(np.repeat(st.reshape(r // tr, c // tc), tr, axis=0), tc, axis=1)
        ok = np.abs(a - b) <= step / 2 * (1 + 1e-5) + np.abs(a) * ROUND[dtype] * 2 + 1e-30
        assert ok.sum() >= ok.size - int(row[5]) and (np.abs(a - b)[~ok] == 0).all()


@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_a_block_without_a_sink_keeps_no_rows(which):
    layout = LAYOUTS[which]("bfloat16")
    x = kv_like(layout.block_bytes // 2, "bfloat16", seed=8)
    codec = Int4Codec()
    assert SinkRows(layout).score(raw_of(x)) > 0.8
    enc = codec.encode(raw_of(x), layout)
    assert flag(codec, enc)[5] == 0 and flag(codec, enc)[3] == 32
    assert frame_bytes(len(enc.meta), len(enc.body)) == codec.encoded_bytes(layout)
    # Small values anywhere but token 0 are no sink.
    y, firsts = with_sink(layout, x, scale=1.0)
    y[firsts[-64:] + 64] = 0  # token 1 of the last head's values: zero
    assert flag(codec, codec.encode(raw_of(y), layout))[5] == 0
    # int8 keeps no sink: five parameters, no flag.
    assert len(Int8Codec().encode(raw_of(with_sink(layout, x)[0]), layout).meta) == len(layout.to_bytes()) + 20


def test_layer_ranges_of_a_sink_block_decode_as_the_whole():
    layout = paged_head_major_layout("bfloat16", 4, 2, 4, 32, 64)
    x, _ = with_sink(layout, kv_like(layout.block_bytes // 2, "bfloat16", seed=9))
    codec = Int4Codec()
    enc = codec.encode(raw_of(x), layout)
    assert flag(codec, enc)[5] == 1
    whole = torch.empty_like(x)
    assert codec.decode(memoryview(enc.meta), memoryview(enc.body), raw_of(whole))
    for ranges in (2, 4):
        parts = torch.zeros_like(x)
        for r in reversed(range(ranges)):
            assert codec.decode_layers(memoryview(enc.meta), memoryview(enc.body), raw_of(parts), r, r + 1, ranges)
        assert torch.equal(parts.view(torch.uint8), whole.view(torch.uint8)), ranges


def test_kept_rows_that_do_not_fit_the_meta_do_not_decode():
    layout = planar_layout("bfloat16", 2, 2, 64, 64)
    codec = Int4Codec()
    x, _ = with_sink(layout, kv_like(layout.block_bytes // 2, "bfloat16", seed=10))
    sink = codec.encode(raw_of(x), layout)
    plain = codec.encode(raw_of(kv_like(layout.block_bytes // 2, "bfloat16", seed=11)), layout)
    out = raw_of(torch.empty_like(x))
    meta, body = bytes(sink.meta), bytes(sink.body)
    kept = SinkRows(layout).bytes
    assert codec.decode(memoryview(meta), memoryview(body), out)
    assert not codec.decode(memoryview(meta), memoryview(body[:-kept]), out)  # the rows missing
    assert not codec.decode(memoryview(meta), memoryview(body + bytes(kept)), out)  # twice
    assert not codec.decode(memoryview(meta[:-4] + (2).to_bytes(4, "little")), memoryview(body), out)  # flag 2
    no_flag = meta[:-4] + (0).to_bytes(4, "little")  # the flag off, value tiles still over 64: body too long
    assert not codec.decode(memoryview(no_flag), memoryview(body), out)
    assert not codec.decode(memoryview(bytes(plain.meta)[:-4] + (1).to_bytes(4, "little")),
                            memoryview(bytes(plain.body)), out)  # the flag on, no rows after the body
    assert codec.decode_layers(memoryview(meta), memoryview(body[:-kept]), out, 0, 1, 2) is False


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("which", sorted(LAYOUTS))
def test_segment_floats_reads_the_segments_rows_and_every_nth_token(dtype, which):
    """What the sink test reads (ucm.codecs.layout.segment_floats): a
    segment of every layer as [layers, heads, tokens, channels], the same
    values the codec's row table names; `every` keeps each page's tokens
    0, every, 2 every, ..."""
    from ucm.codecs.layout import segment_floats

    layout = LAYOUTS[which](dtype)
    x = kv_like(layout.block_bytes // layout.elem_bytes, dtype, seed=12)
    raw = raw_of(x)
    rows = segments(layout, x)  # table order: per layer, K then V, [heads * tokens, channels]
    for j, seg in enumerate(layout.segments):
        got = segment_floats(raw, layout, seg)
        want = np.stack([rows[layer * len(layout.segments) + j] for layer in range(layout.num_layers)])
        assert got.shape == (layout.num_layers, seg.heads, seg.tokens, seg.channels)
        assert np.array_equal(got.reshape(want.shape), want)
        per_page = got.reshape(layout.num_layers, seg.heads, seg.pages, seg.page_tokens, seg.channels)
        assert np.array_equal(segment_floats(raw, layout, seg, 4),
                              per_page[:, :, :, ::4].reshape(layout.num_layers, seg.heads, -1, seg.channels))
    with pytest.raises(ValueError, match="does not divide"):
        segment_floats(raw, layout, layout.segments[0], 5)
