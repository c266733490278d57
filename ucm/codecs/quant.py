"""`int8` and `int4`: KV quantised in the native core (cpp/src/kv_quant.cpp).

Keys are quantised per channel and values per token (KIVI's observation:
key outliers sit in fixed channels, value outliers in tokens):

- `int8`, symmetric: a key tile is one channel of one head over the
  block's tokens, a value tile one token of one head over its channels;
  one fp16 step per tile (rounded up so |x| / s <= 127).
- `int4` (codec id 6), asymmetric, groups of 32: a key tile is one
  channel over 32 tokens, a value tile 32 channels of one token; per tile
  a u8 step code (s = base * 2^(-c/16), base an f32 per segment) and an
  i8 zero point. Values: 4 bits (x' = (q + z) * s, q in 0..15), with s
  the smallest code >= max((max - min) / 15, |min| / 127) and z =
  round(min / s), so the 16 levels span the tile; per segment the 0.2 %
  of elements farthest from their tile's mean are kept exact (KVQuant's
  dense-and-sparse split) with u16 indexes, so one spike does not widen
  its group's step. Keys: each RoPE pair of channels (c, c + D/2, the
  rotate_half convention of Llama-style models in vLLM and transformers)
  of each 32-token group gets its own width of 1-8 bits, 4 on average per
  segment, given where a query would feel the error: the logit error of a
  pair is q . dk, and queries are large in the pairs where keys are, so
  the encoder gives bits greedily to the pair with the largest (its keys'
  mean energy) x (its squared ranges) x 4^-w (format in
  cpp/include/ucm/kv_quant.hpp, "paired"), which lowers int4's
  teacher-forced KL at the same size (docs/lab/benchmarks.md, "int4 keys:
  bits where the queries look").
  A block whose token 0 is an attention sink (ucm.codecs.sinks: its
  values are small) keeps that token's K and V rows exact, after the
  quantised body, and its value tiles span 64 channels, which pays for
  the rows; the sixth parameter says so (1, else 0). Why: see
  ucm.codecs.sinks and docs/lab/benchmarks.md, "int4: the sink token kept
  exact".
  Codec ids 3-5 were the earlier int4 formats (4: every key tile at
  4 bits with 0.2 % outliers; 5: no sink kept, five parameters); their
  frames are misses now (no codec has those ids), as any frame of a codec
  this process lacks.

Every element of a non-outlier comes back within s / 2 of its value (plus
the rounding of x' to the KV dtype); `tile_steps` returns the s of every
tile, which is what the error bound in the tests is derived from.

Encoded size of a block (all integers; n = heads x tokens x channels of
one segment, t = its tiles, o = its outliers, e = element bytes):

    int8: 48 + |layout| + 20 + layers x sum over K, V of (2 t + n)
    int4: 48 + |layout| + 24 + layers x (K + V) [+ layers x 2 x heads x channels x e],
          K = 4 + 2 t + ceil(t / 4) + n / 2   (a nibble per pair of tiles)
          V = 4 + 2 t + o (i + e) + n / 2,     o = floor(2 n / 1000),
                                               i = 2 if n <= 65536 else 4

where 48 is the frame header (ucm.codecs.frame), |layout| the KvLayout's
encoding, 20 or 24 the codec's parameters, and the bracket the sink rows
of a block that keeps them, whose value tiles (in t) span 64 channels
(`encoded_bytes(layout, sink)` computes it; the tests pin it for a
worked geometry).

Blocks the layout does not describe (no layout registered, another size,
a dtype other than float32 / float16 / bfloat16) are not encoded (the
tier stores them raw under `none`).
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from ucm import _native
from ucm.codecs.base import Codec, Encoded
from ucm.codecs.layout import KvLayout
from ucm.codecs.sinks import SinkRows

OUTLIER_PER_MILLE = 2  # elements kept exact per thousand (int4)
GROUP = 32  # int4 group size
SINK_GROUP = 64  # int4: value tiles of a block whose sink token is kept exact span this many channels
_PARAMS = struct.Struct("<IIIII")  # k tile rows, k tile cols, v tile rows, v tile cols, outliers per mille
_PARAMS_SINK = struct.Struct("<IIIIII")  # int4: the same, then the sink tokens kept exact (0 or 1)


class _Plan:
    """The native segment table of one (layout, parameters) pair."""

    def __init__(self, layout: KvLayout, bits: int, params: tuple[int, int, int, int, int],
                 paired_keys: bool = False) -> None:
        ktr, ktc, vtr, vtc, per_mille = params
        rows = []
        row_start, at = 0, 0
        elem = layout.elem_code
        for _layer in range(layout.num_layers):
            for s in layout.segments:
                tr, tc = (ktr, ktc) if s.kind == "k" else (vtr, vtc)
                paired = paired_keys and s.kind == "k"
                n = s.rows * s.channels
                out = n * per_mille // 1000 if bits == 4 and not paired else 0
                size = _native.kv_encoded_bytes(s.rows, s.channels, tr, tc, bits, out, elem, paired)
                rows.append((s.rows, s.channels, tr, tc, bits, out, row_start, at, int(paired)))
                row_start += s.rows
                at += size
        self.table = np.array(rows, dtype=np.int64)
        self.body_bytes = at
        self.elem = elem
        self.row_offsets = layout.block_rows()
        self.num_layers = layout.num_layers
        self.per_layer = len(layout.segments)

    def layer_tables(self, layers: int) -> Optional[list[np.ndarray]]:
        """Per range l of `layers` equal ranges of the block, the table rows
        (segments) that write it: the layout is layer-major and its segments
        cover each layer exactly once (KvLayout), so range l is layout
        layers [l * g, (l + 1) * g) with g = num_layers / layers; None when
        `layers` does not divide num_layers."""
        if layers <= 0 or self.num_layers % layers:
            return None
        rows = self.num_layers // layers * self.per_layer
        return [self.table[i * rows:(i + 1) * rows] for i in range(layers)]


class QuantCodec(Codec):
    """Native per-channel keys / per-token values at `bits` bits."""

    lossy = True
    bits: int
    paired_keys = False  # keys with a width per RoPE pair of tiles (int4)
    keeps_sinks = False  # a block's sink token kept exact (int4; ucm.codecs.sinks)

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._plans: dict[tuple[bytes, tuple[int, ...]], _Plan] = {}
        self._metas: dict[bytes, tuple[KvLayout, tuple[int, ...]]] = {}
        self._sinks: dict[bytes, SinkRows] = {}
        self._struct = _PARAMS_SINK if self.keeps_sinks else _PARAMS

    def params(self, layout: KvLayout, sink: bool = False) -> Optional[tuple[int, ...]]:
        """Tile sizes for this layout (then, for a codec that keeps sinks,
        whether token 0 is kept exact), or None when it cannot be encoded.
        `sink`: the parameters of a block whose sink token is kept: value
        tiles over SINK_GROUP channels where they divide, which pays for the
        kept rows (exactly, in a 16-bit dtype)."""
        if layout.elem_code is None:
            return None
        tokens = {s.tokens for s in layout.segments}
        channels = {s.channels for s in layout.segments}
        if len(tokens) != 1 or len(channels) != 1:
            return None
        t, c = tokens.pop(), channels.pop()
        if self.bits == 8:
            return (t, 1, 1, c, 0)
        if c % 2:
            return None
        ktr = GROUP if t % GROUP == 0 else t
        if self.paired_keys and ktr % 8:  # a key tile's codes must fill whole bytes at any width
            return None
        vtc = GROUP if c % GROUP == 0 else c
        if not self.keeps_sinks:
            return (ktr, 1, 1, vtc, OUTLIER_PER_MILLE)
        if sink and c % SINK_GROUP == 0:
            vtc = SINK_GROUP
        return (ktr, 1, 1, vtc, OUTLIER_PER_MILLE, int(sink))

    def _plan(self, layout: KvLayout, params: tuple[int, ...]) -> _Plan:
        key = (layout.layout_bytes(), params[:5])
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(layout, self.bits, params[:5], self.paired_keys)
        return plan

    def _sink_rows(self, layout: KvLayout) -> SinkRows:
        """Where `layout`'s token-0 rows lie (one per layout)."""
        key = layout.layout_bytes()
        rows = self._sinks.get(key)
        if rows is None:
            rows = self._sinks[key] = SinkRows(layout)
        return rows

    def _kept_bytes(self, layout: KvLayout, params: tuple[int, ...]) -> int:
        """The bytes of the sink rows a block with `params` keeps after the
        quantised body."""
        return self._sink_rows(layout).bytes if len(params) > 5 and params[5] else 0

    def encoded_bytes(self, layout: KvLayout, sink: bool = False) -> Optional[int]:
        """The stored size of one block of `layout` (frame included), or None
        when it is not encoded; the formula of the module docstring.
        `sink`: of a block whose sink token is kept exact."""
        from ucm.codecs.frame import frame_bytes

        params = self.params(layout, sink)
        if params is None:
            return None
        body = self._plan(layout, params).body_bytes + self._kept_bytes(layout, params)
        return frame_bytes(len(layout.to_bytes()) + self._struct.size, body)

    def encode(self, raw: memoryview, layout: Optional[KvLayout]) -> Optional[Encoded]:
        if layout is None or len(raw) != layout.block_bytes:
            return None
        params = self.params(layout)
        if params is None:
            return None
        sink = self.keeps_sinks and self._sink_rows(layout).is_sink(raw)
        if sink:
            params = self.params(layout, sink=True)
        plan = self._plan(layout, params)
        n = plan.body_bytes
        body = np.empty(n + self._kept_bytes(layout, params), dtype=np.uint8)
        if not _native.kv_encode(raw, plan.row_offsets, plan.table, plan.elem, body[:n], self.threads):
            return None  # non-finite values, or beyond half precision
        if sink:
            self._sink_rows(layout).gather(raw, body[n:])
        return Encoded(layout.layout_bytes() + self._struct.pack(*params), body)

    def split_meta(self, meta: memoryview) -> Optional[tuple[KvLayout, tuple[int, ...]]]:
        """(layout, parameters) of a block's meta; parsed once per distinct
        meta (a handful: one per namespace layout)."""
        key = bytes(meta)
        got = self._metas.get(key)
        if got is not None:
            return got
        ps = self._struct
        if len(meta) < ps.size:
            return None
        try:
            layout = KvLayout.from_bytes(key[:-ps.size])
        except ValueError:  # ArgumentError is a ValueError
            return None
        got = (layout, ps.unpack(key[-ps.size:]))
        if len(got[1]) > 5 and got[1][5] > 1:
            return None
        if len(self._metas) < 64:
            self._metas[key] = got
        return got

    def _opened(self, meta: memoryview, body: memoryview,
                out: memoryview) -> Optional[tuple[_Plan, int, Optional[SinkRows]]]:
        """(plan, quantised body bytes, the kept rows' places or None) of a
        block to decode into `out`, or None when its meta, body or `out` do
        not fit together."""
        got = self.split_meta(meta)
        if got is None:
            return None
        layout, params = got
        if layout.elem_code is None or len(out) != layout.block_bytes:
            return None
        kept = len(params) > 5 and params[5]
        if kept and self.params(layout) is None:  # a layout the sink rows cannot be taken from
            return None
        try:
            plan = self._plan(layout, params)
        except ValueError:  # parameters the native core refuses
            return None
        if len(body) != plan.body_bytes + self._kept_bytes(layout, params):
            return None
        return plan, plan.body_bytes, self._sink_rows(layout) if kept else None

    def decode(self, meta: memoryview, body: memoryview, out: memoryview) -> bool:
        got = self._opened(meta, body, out)
        if got is None:
            return False
        plan, n, sinks = got
        if not _native.kv_decode(body[:n], plan.table, plan.elem, out, plan.row_offsets, self.threads):
            return False
        if sinks is not None:
            sinks.scatter(body[n:], out)
        return True

    def decode_layers(self, meta: memoryview, body: memoryview, out: memoryview, first: int, last: int,
                      layers: int) -> Optional[bool]:
        """Only the segments of layer ranges [first, last) (Codec.decode_layers;
        None when this block's segments do not split into `layers` ranges)."""
        got = self._opened(meta, body, out)
        if got is None:
            return False
        plan, n, sinks = got
        tables = plan.layer_tables(layers)
        if tables is None or not 0 <= first < last <= layers:
            return None
        part = np.concatenate(tables[first:last])
        if not _native.kv_decode(body[:n], part, plan.elem, out, plan.row_offsets, self.threads):
            return False
        if sinks is not None:
            g = plan.num_layers // layers
            sinks.scatter(body[n:], out, first * g, last * g)
        return True

    def tile_steps(self, meta: memoryview, body: memoryview) -> list[np.ndarray]:
        """The quantisation step of every tile of every segment (the error
        bound of an element is half its tile's step), in table order."""
        layout, params = self.split_meta(meta)
        plan = self._plan(layout, params)
        return [np.frombuffer(_native.kv_tile_steps(body, int(r[7]), *map(int, r[:6]), plan.elem, bool(r[8])),
                              np.float32)
                for r in plan.table]


class Int8Codec(QuantCodec):
    name = "int8"
    codec_id = 2
    bits = 8
    nominal_ratio = 1.9


class Int4Codec(QuantCodec):
    name = "int4"
    codec_id = 6  # 3-5: the earlier int4 formats, retired (their frames are misses)
    bits = 4
    paired_keys = True
    keeps_sinks = True
    nominal_ratio = 3.5
