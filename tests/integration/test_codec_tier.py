"""Codec tiers below DRAM over the real dram and nvme adapters: blocks are
encoded on demotion and decoded on staging; a block is decoded by the codec
its frame records whatever this cache is configured with, or is a miss;
corrupted stored bytes, unknown codec ids and foreign raw bytes are misses;
range reads return exactly the decoded bytes; bad config names the key;
streamed reads land layer range by layer range. The write-behind is in
test_codec_writer.py."""
import pathlib
import tomllib

import numpy as np
import pytest
import torch

from codec_support import LAYOUT, N, DictAdapter, cfg, int8_decoded, kv_blocks
from ucm.adapters.base import RangeReads, Status, read_range
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.codecs import _BUILTIN, codec_class_by_id, codec_names, load_codec_class
from ucm.codecs.frame import HEADER_BYTES, pack
from ucm.codecs.layout import LayoutBook, planar_layout
from ucm.codecs.quant import Int8Codec
from ucm.codecs.reads import LAYER_RANGES, layer_ranges
from ucm.codecs.tier import CodecAdapter
from ucm.errors import ArgumentError, ConfigError


def load(cache, keys):
    out = [bytearray(LAYOUT.block_bytes) for _ in keys]
    return cache.load(keys, out).wait(30), [bytes(o) for o in out]


def rel_err(a, b):
    x = torch.frombuffer(bytearray(a), dtype=torch.bfloat16).float()
    y = torch.frombuffer(bytearray(b), dtype=torch.bfloat16).float()
    return ((x - y).norm() / x.norm()).item()


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_demoted_blocks_are_stored_encoded_and_come_back_decoded(nvme_dir, codec):
    keys, data = kv_blocks(N, 1)
    with UnifiedCache(cfg(nvme_dir, codec)) as c:
        c.register_layout(LAYOUT)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * N
        where = c.locate(keys)
        assert "nvme" in where
        res, out = load(c, keys)
        assert res == [Outcome.DONE] * N
        s = c.stats()["tiers"]["nvme"]["adapter"]
        assert s["codec"] == codec and s["codec_decoded_blocks"] > 0 and s.get("codec_fallback", 0) == 0
        ratio = s["codec_raw_bytes_in"] / s["codec_stored_bytes_out"]
    staged = [i for i, t in enumerate(where) if t == "nvme"]  # only there: read back through the codec
    assert all(out[i] == data[i] for i in range(N) if i not in staged)
    if codec == "lossless":
        assert out == data and ratio > 1.0
    elif codec == "int8":  # 64 KiB blocks of 32 tokens: 1.90x (SmolLM2's 128-token blocks: 1.95x)
        assert all(out[i] == int8_decoded(data[i]) != data[i] for i in staged) and ratio > 1.85
    else:
        assert all(0.02 < rel_err(data[i], out[i]) < 0.12 for i in staged) and ratio > 3.4


def test_capacity_counts_encoded_bytes(nvme_dir):
    with UnifiedCache(cfg(nvme_dir, "int4")) as c:
        medium = c.adapters[1].inner.capacity_bytes
        assert c.stats()["tiers"]["nvme"]["capacity_bytes"] == int(medium * 3.5)
    with UnifiedCache(cfg(pathlib.Path(nvme_dir) / "b", "none")) as c:
        assert c.stats()["tiers"]["nvme"]["capacity_bytes"] == medium


def test_without_a_layout_blocks_are_stored_raw_and_still_exact(nvme_dir):
    keys, data = kv_blocks(N, 2)
    with UnifiedCache(cfg(nvme_dir, "int8")) as c:
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * N
        res, out = load(c, keys)
        assert res == [Outcome.DONE] * N and out == data
        assert c.stats()["tiers"]["nvme"]["adapter"]["codec_fallback"] > 0


@pytest.mark.parametrize("reader", ["int4", "lossless"])
def test_a_block_is_decoded_by_its_recorded_codec_whatever_the_reader_is_configured_with(nvme_dir, reader):
    keys, data = kv_blocks(N, 3)
    with UnifiedCache(cfg(nvme_dir, "int8")) as c:
        c.register_layout(LAYOUT)
        c.store(keys, data).wait(30)
        on_nvme = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"]
        assert c.flush(30)
    # A restart with another codec: only the NVMe log survives (DRAM is gone).
    with UnifiedCache(cfg(nvme_dir, reader)) as c:
        assert c.lookup(on_nvme) == len(on_nvme) and on_nvme
        res, out = load(c, on_nvme)
        assert res == [Outcome.DONE] * len(on_nvme)
        want = {k: int8_decoded(d) for k, d in zip(keys, data)}
        assert all(o == want[k] for k, o in zip(on_nvme, out))


def test_a_reader_without_the_codec_misses_instead_of_handing_on_encoded_bytes(nvme_dir):
    keys, data = kv_blocks(N, 4)
    with UnifiedCache(cfg(nvme_dir, "int8")) as c:
        c.register_layout(LAYOUT)
        c.store(keys, data).wait(30)
        on_nvme = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"]
        assert c.flush(30)
    with UnifiedCache(cfg(nvme_dir, "none")) as c:
        res, out = load(c, on_nvme)
        assert Outcome.DONE not in res  # the stored frame is smaller than a block: CORRUPT, never bytes
        assert all(o == bytes(LAYOUT.block_bytes) for o in out)


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_every_corrupted_byte_is_a_miss(codec):
    book = LayoutBook()
    book.register(LAYOUT)
    medium = DictAdapter()
    a = CodecAdapter(medium, load_codec_class(codec)(), book)
    keys, data = kv_blocks(1, 5)
    assert a.put(keys, data) == [Status.OK] and a.flush(30)
    stored = medium.blobs[keys[0]]
    rng = np.random.default_rng(0)
    for pos in [0, 8, 20, 40, HEADER_BYTES, HEADER_BYTES + 3, *rng.integers(HEADER_BYTES, len(stored), 20)]:
        stored[pos] ^= 0x10
        out = bytearray(LAYOUT.block_bytes)
        assert a.get(keys, [out]) == [Status.CORRUPT], pos
        stored[pos] ^= 0x10
    assert a.get(keys, [bytearray(LAYOUT.block_bytes)]) == [Status.OK]
    assert a.get(keys, [bytearray(LAYOUT.block_bytes - 2)]) == [Status.CORRUPT]  # another raw size


def test_unknown_codec_ids_and_raw_bytes_are_misses():
    medium = DictAdapter()
    a = CodecAdapter(medium, load_codec_class("int8")(), LayoutBook())
    keys, data = kv_blocks(2, 6)
    medium.blobs[keys[0]] = pack(200, len(data[0]), b"", data[0])  # a well-formed frame of a codec nobody has
    medium.blobs[keys[1]] = bytearray(data[1])  # raw bytes that never were a frame
    assert a.size_of(keys[0]) == len(data[0])
    assert a.get(keys, [bytearray(len(data[0])), bytearray(len(data[1]))]) == [Status.CORRUPT] * 2
    assert a.stats()["codec_unknown_id"] == 1 and a.stats()["codec_bad_frames"] == 1


@pytest.mark.parametrize("retired", [3, 4, 5])
def test_a_frame_of_a_retired_int4_format_is_a_miss(retired):
    """int4's earlier formats (codec id 3: u32 outlier indexes; id 4: every
    key tile at 4 bits, with key outliers; id 5: no sink token kept, 20
    bytes of parameters) are no codec's any more: a block
    stored by one is a miss for an int4 tier of today, never decoded with
    the new format's offsets."""
    from ucm.codecs.quant import Int4Codec

    assert Int4Codec.codec_id == 6 and codec_class_by_id(retired) is None
    medium = DictAdapter()
    book = LayoutBook()
    book.register(LAYOUT)
    a = CodecAdapter(medium, Int4Codec(), book)
    keys, data = kv_blocks(2, 9)
    enc = Int4Codec().encode(memoryview(data[0]), LAYOUT)
    medium.blobs[keys[0]] = pack(retired, len(data[0]), enc.meta, enc.body)  # well formed, checksums good
    medium.blobs[keys[1]] = pack(Int4Codec.codec_id, len(data[1]), enc.meta, enc.body)  # the same bytes under today's id
    assert a.get(keys[:1], [bytearray(len(data[0]))]) == [Status.CORRUPT]
    assert a.stats()["codec_unknown_id"] == 1
    assert a.get(keys[1:], [bytearray(len(data[1]))]) == [Status.OK]


@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_a_range_read_returns_exactly_the_decoded_bytes_of_the_range(nvme_dir, codec):
    from ucm.adapters.nvme import NvmeAdapter

    book = LayoutBook()
    book.register(LAYOUT)
    inner = NvmeAdapter(capacity_bytes=16 << 20, config=NvmeAdapter.Config(path=str(nvme_dir), region_size="512KiB",
                                                                          io_chunk="128KiB"))
    with CodecAdapter(inner, load_codec_class(codec)(), book) as a:
        keys, data = kv_blocks(3, 7)
        assert a.put(keys, data) == [Status.OK] * 3
        assert a.flush(30)
        lb = LAYOUT.layer_bytes
        offsets = [lb, 0, 2 * lb + 100]
        dsts = [bytearray(lb), bytearray(2 * lb), bytearray(lb - 300)]
        assert read_range(a, keys, offsets, dsts) == [Status.OK] * 3
        for k, d, off, dst in zip(keys, data, offsets, dsts):
            full = bytearray(LAYOUT.block_bytes)
            assert a.get([k], [full]) == [Status.OK]
            assert bytes(dst) == bytes(full[off:off + len(dst)])
            if codec == "lossless":
                assert bytes(dst) == d[off:off + len(dst)]
        assert read_range(a, [keys[0]], [LAYOUT.block_bytes - 10], [bytearray(20)]) == [Status.CORRUPT]
        assert not isinstance(a, RangeReads)  # streamed loads read a codec block whole, once
        entries = list(a.iter_entries())
        assert {e.key: e.size_bytes for e in entries} == {k: LAYOUT.block_bytes for k in keys}


@pytest.mark.parametrize("codec", ["lossless", "int8", "int4"])
def test_frames_are_read_in_place_from_nvme_and_decode_as_from_any_medium(nvme_dir, codec):
    """The codec tier reads nvme frames (never whole pages) with padded
    reads straight into its scratch (PaddedReads): none go through the
    medium's own scratch, and the decoded bytes are those a medium without
    padded reads (a dict) gives for the same frames."""
    from ucm.adapters.nvme import NvmeAdapter

    book = LayoutBook()
    book.register(LAYOUT)
    inner = NvmeAdapter(capacity_bytes=16 << 20, config=NvmeAdapter.Config(path=str(nvme_dir), region_size="512KiB",
                                                                          io_chunk="128KiB"))
    keys, data = kv_blocks(4, 11)
    with CodecAdapter(inner, load_codec_class(codec)(), book) as a, \
            CodecAdapter(DictAdapter(), load_codec_class(codec)(), book) as b:
        assert a.put(keys, data) == [Status.OK] * 4 and a.flush(30)
        assert b.put(keys, data) == [Status.OK] * 4 and b.flush(30)
        assert any(inner.size_of(k) % inner.read_unit for k in keys)
        out_a = [bytearray(LAYOUT.block_bytes) for _ in keys]
        out_b = [bytearray(LAYOUT.block_bytes) for _ in keys]
        assert a.get(keys, out_a) == [Status.OK] * 4 and b.get(keys, out_b) == [Status.OK] * 4
        assert out_a == out_b
        landed = []
        out_c = [bytearray(LAYOUT.block_bytes) for _ in keys]
        assert a.get_layers(keys, out_c, 2, lambda i, f, t: landed.append(i)) == [Status.OK] * 4
        assert out_c == out_a and sorted(set(landed)) == [0, 1, 2, 3]
        assert inner.stats()["bytes_read"] > 0 and inner._scratch.made == 0


def test_bad_codec_config_names_the_key_and_the_allowed_values(nvme_dir):
    with pytest.raises(ConfigError, match=r"tiers\.1\.codec: unknown codec 'zip'.*allowed: .*int4.*lossless"):
        UnifiedCache(cfg(nvme_dir, "zip"))
    bad = cfg(nvme_dir, "none")
    bad["tiers"][0]["codec"] = "int8"
    with pytest.raises(ConfigError, match=r"tiers\.0\.codec: the landing tier"):
        UnifiedCache(bad)


def test_the_shipped_codecs_are_entry_points_and_in_the_built_in_table():
    text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    eps = tomllib.loads(text)["project"]["entry-points"]["ucm.codecs"]
    assert eps == _BUILTIN
    assert set(eps) <= set(codec_names())
    ids = {load_codec_class(n).codec_id for n in eps}
    assert len(ids) == len(eps) and all(0 <= i < 16 for i in ids)
    assert "zstandard" in " ".join(tomllib.loads(text)["project"]["dependencies"])


class BudgetAdapter(DictAdapter):
    """A medium with a byte budget that answers NO_SPACE past it, as the
    redis and mooncake adapters do."""

    def __init__(self, capacity_bytes):
        super().__init__()
        self.capacity_bytes = capacity_bytes

    def put(self, keys, blobs):
        out = []
        for k, b in zip(keys, blobs):
            if k not in self.blobs and self.used_bytes + len(b) > self.capacity_bytes:
                out.append(Status.NO_SPACE)
                continue
            self.blobs.setdefault(k, bytearray(b))
            out.append(Status.OK)
        return out


def test_blocks_that_encode_worse_than_the_nominal_ratio_never_freeze_a_budgeted_tier(nvme_dir):
    """No layout is registered, so every block is stored raw while the
    placement plans the int4 tier at 3.5x its bytes: the medium's budget
    fills long before the placement evicts. The newest demoted blocks must
    stay cached (the oldest give way), not be lost one by one while the
    tier keeps its oldest."""
    medium = 16 * LAYOUT.block_bytes

    def factory(i, cls, cap, options):
        return BudgetAdapter(medium) if i == 1 else cls(capacity_bytes=cap, config=options)

    keys, data = kv_blocks(80, 9)
    with UnifiedCache(cfg(nvme_dir, "int4"), tier_factory=factory) as c:
        for k, d in zip(keys, data):  # one at a time: each store demotes the coldest DRAM block
            assert c.store([k], [d]).wait(30) == [Outcome.DONE]
        newest = keys[-24:]  # 1 MiB of DRAM (<= 16 blocks) plus < 16 in the medium
        where = c.locate(newest)
        assert all(t is not None for t in where), where
        res, out = load(c, newest)
        assert res == [Outcome.DONE] * len(newest) and out == data[-24:]
        nv = c.stats()["tiers"]["nvme"]["adapter"]
        assert nv["codec_fallback"] > 0 and nv["codec_room_evictions"] > 0


class RaisingCodec(Int8Codec):
    name = "raising"
    codec_id = 200

    def encode(self, raw, layout):
        raise RuntimeError("a codec bug")


def test_a_codec_that_raises_stores_the_block_raw_instead_of_failing_the_batch():
    book = LayoutBook()
    book.register(LAYOUT)
    a = CodecAdapter(DictAdapter(), RaisingCodec(), book)
    keys, data = kv_blocks(3, 11)
    assert a.put(keys, data) == [Status.OK] * 3
    outs = [bytearray(LAYOUT.block_bytes) for _ in keys]
    assert a.get(keys, outs) == [Status.OK] * 3 and [bytes(o) for o in outs] == data
    assert a.stats()["codec_fallback"] == 3


def test_an_encoding_no_smaller_than_the_block_is_stored_raw():
    """int8 on one-token blocks: a key tile is a single element (2 bytes of
    step per byte of code), so the encoding is larger than the block."""
    lay = planar_layout("bfloat16", 2, 2, 1, 64)
    book = LayoutBook()
    book.register(lay)
    inner = DictAdapter()
    a = CodecAdapter(inner, Int8Codec(), book)
    raw = (torch.randn(lay.block_bytes // 2) * 3).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    key = kv_blocks(1, 12)[0]
    assert a.put(key, [raw]) == [Status.OK] and a.flush(30)
    assert len(inner.blobs[key[0]]) == HEADER_BYTES + len(raw)
    out = bytearray(len(raw))
    assert a.get(key, [out]) == [Status.OK] and bytes(out) == raw


@pytest.mark.parametrize("beside", [None, "real"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_blocks_of_an_opaque_size_are_stored_raw_and_exact(codec, beside):
    """A connector that does not know its K/V order (SGLang's pages, vLLM's
    device pages) registers an opaque layout of its block size: alone, or
    beside another engine's real layout of the same size, a lossy codec
    never quantises those blocks (stored raw, bit-exact)."""
    from ucm.codecs.layout import opaque_layout

    book = LayoutBook()
    book.register(opaque_layout(LAYOUT.block_bytes))
    if beside:
        book.register(LAYOUT)
    a = CodecAdapter(DictAdapter(), load_codec_class(codec)(), book)
    keys, data = kv_blocks(3, 11)
    assert a.put(keys, data) == [Status.OK] * 3
    out = [bytearray(LAYOUT.block_bytes) for _ in keys]
    assert a.get(keys, out) == [Status.OK] * 3 and [bytes(o) for o in out] == data
    assert a.stats()["codec_fallback"] == 3


def test_an_opaque_layout_needs_a_positive_size():
    from ucm.codecs.layout import opaque_layout

    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ArgumentError):
            opaque_layout(bad)


@pytest.mark.parametrize("codec", ["int8", "int4", "lossless"])
def test_a_layered_read_lands_each_layer_with_the_bytes_a_whole_decode_gives(codec):
    """`get_layers` (streamed loads from a codec tier): int8 and int4 decode
    layer range by layer range (`layer_ranges`), in order, across the blocks, each range's
    bytes final when it is reported landed and equal to a whole decode;
    lossless cannot decode part of a block and lands it whole; a
    corrupted frame lands nothing and is CORRUPT."""
    book = LayoutBook()
    book.register(LAYOUT)
    medium = DictAdapter()
    a = CodecAdapter(medium, load_codec_class(codec)(), book)
    keys, data = kv_blocks(3, 11)
    assert a.put(keys, data) == [Status.OK] * 3 and a.flush(30)
    whole = [bytearray(LAYOUT.block_bytes) for _ in keys]
    assert a.get(keys, whole) == [Status.OK] * 3
    bad = medium.blobs[keys[2]]
    bad[len(bad) // 2] ^= 0x01
    layers, w = LAYOUT.num_layers, LAYOUT.layer_bytes
    outs = [bytearray(b"\xee" * LAYOUT.block_bytes) for _ in keys]
    seen = []

    def landed(i, first, last):
        seen.append((i, first, last))
        assert outs[i][first * w:last * w] == whole[i][first * w:last * w]  # final when reported
        if last < layers:  # later layers untouched yet (the fill byte)
            assert set(outs[i][last * w:]) == {0xee}

    assert a.get_layers(keys, outs, layers, landed) == [Status.OK, Status.OK, Status.CORRUPT]
    assert outs[:2] == whole[:2] and 2 not in {i for i, _, _ in seen}
    if codec == "lossless":
        assert sorted(seen) == [(0, 0, layers), (1, 0, layers)]
    else:
        assert seen == [(i, first, last) for first, last in layer_ranges(layers) for i in (0, 1)]
        assert len(layer_ranges(layers)) > 1  # the layout splits: a real range-by-range landing
        assert a.stats()["codec_layer_decoded_blocks"] == 2


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 5, 30, 61])
def test_layer_ranges_cover_every_layer_once_in_order(layers):
    """The ranges of a streamed codec decode: consecutive, covering
    [0, layers), LAYER_RANGES at most, none empty, the first no larger
    than a later one (it lands soonest)."""
    got = layer_ranges(layers)
    assert got[0][0] == 0 and got[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    assert all(last > first for first, last in got)
    assert len(got) == min(LAYER_RANGES, layers)
    sizes = [last - first for first, last in got]
    assert sizes[0] == min(sizes) and max(sizes) - min(sizes) <= 1


def test_a_stream_from_an_int8_tier_lands_layer_by_layer(nvme_dir):
    """Through the cache: a streamed load of blocks held only in an int8
    NVMe tier gets the int8-decoded bytes of every layer, decoded layer by
    layer (the tier's counter), and the blocks are staged into DRAM."""
    keys, data = kv_blocks(N, 12)
    with UnifiedCache(cfg(nvme_dir, "int8")) as c:
        c.register_layout(LAYOUT)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * N
        on_nvme = [i for i, t in enumerate(c.locate(keys)) if t == "nvme"][:4]
        assert len(on_nvme) == 4
        s = c.stream_slots([keys[i] for i in on_nvme], [LAYOUT.block_bytes] * 4, LAYOUT.num_layers)
        try:
            assert s.outcomes(30.0) == [Outcome.DONE] * 4
            for j, i in enumerate(on_nvme):
                off, n = s.slots[j]
                assert bytes(memoryview(s.arena)[off:off + n]) == int8_decoded(data[i])
        finally:
            s.release()
        assert c.stats()["tiers"]["nvme"]["adapter"]["codec_layer_decoded_blocks"] == 4
        assert c.locate([keys[i] for i in on_nvme]) == ["dram"] * 4
