"""`int8` and `int4`: KV quantised in the native core (cpp/src/kv_quant.cpp).

Keys are quantised per channel and values per token (KIVI's observation:
key outliers sit in fixed channels, value outliers in tokens):

- `int8`, symmetric: a key tile is one channel of one head over the
  block's tokens, a value tile one token of one head over its channels;
  one fp16 step per tile (rounded up so |x| / s <= 127).
- `int4` (codec id 5), asymmetric, groups of 32: a key tile is one
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
  cpp/include/ucm/kv_quant.hpp, "paired"). On four SmolLM2 documents
  that cut int4's teacher-forced KL from 0.0045 to 0.0018 at the same
  size (docs/benchmarks.md, "int4 keys: bits where the queries look").
  Codec ids 3 and 4 were the earlier int4 formats (4: every key tile at
  4 bits with 0.2 % outliers); their frames are misses now (no codec has
  those ids), as any frame of a codec this process lacks.

Every element of a non-outlier comes back within s / 2 of its value (plus
the rounding of x' to the KV dtype); `tile_steps` returns the s of every
tile, which is what the error bound in the tests is derived from.

Encoded size of a block (all integers; n = heads x tokens x channels of
one segment, t = its tiles, o = its outliers, e = element bytes):

    int8: 48 + |layout| + 20 + layers x sum over K, V of (2 t + n)
    int4: 48 + |layout| + 20 + layers x (K + V),
          K = 4 + 2 t + ceil(t / 4) + n / 2   (a nibble per pair of tiles)
          V = 4 + 2 t + o (i + e) + n / 2,     o = floor(2 n / 1000),
                                               i = 2 if n <= 65536 else 4

where 48 is the frame header (ucm.codecs.frame), |layout| the KvLayout's
encoding and 20 the codec's parameters (`encoded_bytes` computes it). For
SmolLM2 in bf16 at 128 tokens (3 heads, 64 channels, 30 layers; a
126-byte layout) that is 1,509,314 bytes for int8 (1.954x) and 841,514
bytes for int4 (3.505x) against 2,949,120 raw (n = 24,576, t = 768,
o = 49 per value segment).

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

OUTLIER_PER_MILLE = 2  # elements kept exact per thousand (int4)
GROUP = 32  # int4 group size
_PARAMS = struct.Struct("<IIIII")  # k tile rows, k tile cols, v tile rows, v tile cols, outliers per mille


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
    paired_keys = False  # keys with a width per RoPE pair of tiles (int4, codec id 5)

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._plans: dict[tuple[bytes, tuple[int, ...]], _Plan] = {}
        self._metas: dict[bytes, tuple[KvLayout, tuple[int, int, int, int, int]]] = {}

    def params(self, layout: KvLayout) -> Optional[tuple[int, int, int, int, int]]:
        """Tile sizes for this layout, or None when it cannot be encoded."""
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
        return (ktr, 1, 1, GROUP if c % GROUP == 0 else c, OUTLIER_PER_MILLE)

    def _plan(self, layout: KvLayout, params: tuple[int, int, int, int, int]) -> _Plan:
        key = (layout.layout_bytes(), params)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(layout, self.bits, params, self.paired_keys)
        return plan

    def encoded_bytes(self, layout: KvLayout) -> Optional[int]:
        """The stored size of one block of `layout` (frame included), or None
        when it is not encoded; the formula of the module docstring."""
        from ucm.codecs.frame import frame_bytes

        params = self.params(layout)
        if params is None:
            return None
        return frame_bytes(len(layout.to_bytes()) + _PARAMS.size, self._plan(layout, params).body_bytes)

    def encode(self, raw: memoryview, layout: Optional[KvLayout]) -> Optional[Encoded]:
        if layout is None or len(raw) != layout.block_bytes:
            return None
        params = self.params(layout)
        if params is None:
            return None
        plan = self._plan(layout, params)
        body = np.empty(plan.body_bytes, dtype=np.uint8)
        if not _native.kv_encode(raw, plan.row_offsets, plan.table, plan.elem, body, self.threads):
            return None  # non-finite values, or beyond half precision
        return Encoded(layout.layout_bytes() + _PARAMS.pack(*params), body)

    def split_meta(self, meta: memoryview) -> Optional[tuple[KvLayout, tuple[int, int, int, int, int]]]:
        """(layout, parameters) of a block's meta; parsed once per distinct
        meta (a handful: one per namespace layout)."""
        key = bytes(meta)
        got = self._metas.get(key)
        if got is not None:
            return got
        if len(meta) < _PARAMS.size:
            return None
        try:
            layout = KvLayout.from_bytes(key[:-_PARAMS.size])
        except ValueError:  # ArgumentError is a ValueError
            return None
        got = (layout, _PARAMS.unpack(key[-_PARAMS.size:]))
        if len(self._metas) < 64:
            self._metas[key] = got
        return got

    def decode(self, meta: memoryview, body: memoryview, out: memoryview) -> bool:
        got = self.split_meta(meta)
        if got is None:
            return False
        layout, params = got
        if layout.elem_code is None or len(out) != layout.block_bytes:
            return False
        try:
            plan = self._plan(layout, params)
        except ValueError:  # parameters the native core refuses
            return False
        if len(body) != plan.body_bytes:
            return False
        return bool(_native.kv_decode(body, plan.table, plan.elem, out, plan.row_offsets, self.threads))

    def decode_layers(self, meta: memoryview, body: memoryview, out: memoryview, first: int, last: int,
                      layers: int) -> Optional[bool]:
        """Only the segments of layer ranges [first, last) (Codec.decode_layers;
        None when this block's segments do not split into `layers` ranges)."""
        got = self.split_meta(meta)
        if got is None:
            return False
        layout, params = got
        if layout.elem_code is None or len(out) != layout.block_bytes:
            return False
        try:
            plan = self._plan(layout, params)
        except ValueError:
            return False
        if len(body) != plan.body_bytes:
            return False
        tables = plan.layer_tables(layers)
        if tables is None or not 0 <= first < last <= layers:
            return None
        part = np.concatenate(tables[first:last])
        return bool(_native.kv_decode(body, part, plan.elem, out, plan.row_offsets, self.threads))

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
    codec_id = 5  # 3 and 4: the first two int4 formats, retired (their frames are misses)
    bits = 4
    paired_keys = True
    nominal_ratio = 3.5
