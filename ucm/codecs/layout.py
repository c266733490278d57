"""The physical layout of a block's KV bytes: which bytes are K and V of
which layer, their dtype, and the head / token / channel axes.

A connector copies engine pages verbatim, so only it knows how the bytes
of a block are ordered (vLLM's CPU backend: per page, per head, all K of
the page then all V; the transformers connector: per layer K then V, each
`[heads, tokens, channels]`). It describes that once per namespace with a
`KvLayout` and registers it with its cache (`CacheAPI.register_layout`);
the codecs of the tiers below DRAM read it. The layout is a function of
the namespace (dtype, layers, KV heads, head size, block tokens and the
layout name in `Namespace.layout`), so the namespace digest already fixes
it: two layouts never share keys. Pure Python and numpy, no torch.

Every layer has the same segments (`segments`, offsets inside the layer;
layer l starts at `l * layer_bytes`). A segment is `heads x pages x
page_tokens` rows of `channels` contiguous elements; together the
segments of a layer cover its bytes exactly once (checked).

Encoding (`to_bytes`, version 1, little-endian): b"ucmkv" u8 version,
u8 len(dtype) dtype, u32 num_layers, u64 layer_bytes, u8 segment count,
then per segment: u8 kind (b"k"/b"v"), u64 offset, u32 heads, u64
head_stride, u32 pages, u64 page_stride, u32 page_tokens, u64
token_stride, u32 channels.

`LayoutBook` holds the layouts registered with one cache, by block size:
what a codec tier encodes a block of that size with.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ucm import _native
from ucm.errors import ArgumentError

_TAG = b"ucmkv"
_VERSION = 1
_HEAD = struct.Struct("<IQB")
_SEG = struct.Struct("<cQIQIQIQI")
# Element types the quantising codecs read (ucm._native's KvElem codes).
ELEM_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ELEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1, "float8_e5m2": 1,
              "int8": 1, "uint8": 1}
# How `segment_floats` reads the elements of each dtype before they become float32.
_READ = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
FLOAT_DTYPES = tuple(sorted(_READ))


@dataclass(frozen=True, slots=True)
class KvSegmentSpec:
    """K or V of one layer: `heads x pages x page_tokens` rows of
    `channels` contiguous elements, row (h, p, t) at `offset + h *
    head_stride + p * page_stride + t * token_stride` bytes into the layer."""

    kind: str  # "k" or "v"
    offset: int
    heads: int
    head_stride: int
    pages: int
    page_stride: int
    page_tokens: int
    token_stride: int
    channels: int

    @property
    def rows(self) -> int:
        return self.heads * self.pages * self.page_tokens

    @property
    def tokens(self) -> int:
        return self.pages * self.page_tokens

    def row_offsets(self) -> np.ndarray:
        """Byte offsets in the layer of every row, the rows of one head
        consecutive, tokens in order."""
        h = np.arange(self.heads, dtype=np.int64)[:, None, None] * self.head_stride
        p = np.arange(self.pages, dtype=np.int64)[None, :, None] * self.page_stride
        t = np.arange(self.page_tokens, dtype=np.int64)[None, None, :] * self.token_stride
        return (self.offset + h + p + t).reshape(-1)


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The KV layout of every block of one namespace (see the module docstring)."""

    dtype: str
    num_layers: int
    layer_bytes: int
    segments: tuple[KvSegmentSpec, ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if self.dtype not in ELEM_BYTES:
            raise ArgumentError(f"KvLayout.dtype {self.dtype!r} not one of {sorted(ELEM_BYTES)}")
        if self.num_layers <= 0 or self.layer_bytes <= 0 or not self.segments:
            raise ArgumentError(f"KvLayout needs layers, layer_bytes and segments > 0, got {self.num_layers}, "
                                f"{self.layer_bytes}, {len(self.segments)}")
        eb = ELEM_BYTES[self.dtype]
        covered = np.zeros(self.layer_bytes, dtype=np.uint8)
        for s in self.segments:
            if s.kind not in ("k", "v"):
                raise ArgumentError(f"KvLayout segment kind {s.kind!r} not 'k' or 'v'")
            if min(s.heads, s.pages, s.page_tokens, s.channels) <= 0 or min(s.offset, s.head_stride,
                                                                            s.page_stride, s.token_stride) < 0:
                raise ArgumentError(f"KvLayout segment {s} has an empty or negative axis")
            offs = s.row_offsets()
            if offs.max() + s.channels * eb > self.layer_bytes:
                raise ArgumentError(f"KvLayout segment {s} reaches past the layer ({self.layer_bytes} bytes)")
            for o in offs:
                covered[o:o + s.channels * eb] += 1
        if not (covered == 1).all():
            raise ArgumentError("KvLayout segments must cover every byte of a layer exactly once")

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def elem_code(self) -> Optional[int]:
        """The native element code, or None for a dtype the quantisers do not read."""
        return ELEM_CODES.get(self.dtype)

    def to_bytes(self) -> bytes:
        d = self.dtype.encode("ascii")
        out = [_TAG, bytes((_VERSION, len(d))), d, _HEAD.pack(self.num_layers, self.layer_bytes, len(self.segments))]
        for s in self.segments:
            out.append(_SEG.pack(s.kind.encode("ascii"), s.offset, s.heads, s.head_stride, s.pages, s.page_stride,
                                 s.page_tokens, s.token_stride, s.channels))
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> "KvLayout":
        """Parses `to_bytes`; ArgumentError for anything else."""
        data = bytes(data)
        try:
            if data[:5] != _TAG or data[5] != _VERSION:
                raise ValueError("not a version-1 KV layout")
            n = data[6]
            dtype = data[7:7 + n].decode("ascii")
            at = 7 + n
            layers, layer_bytes, count = _HEAD.unpack_from(data, at)
            at += _HEAD.size
            segs = []
            for _ in range(count):
                f = _SEG.unpack_from(data, at)
                at += _SEG.size
                segs.append(KvSegmentSpec(f[0].decode("ascii"), *f[1:]))
            if at != len(data):
                raise ValueError(f"{len(data) - at} bytes after the layout")
        except (ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
            raise ArgumentError(f"bad KV layout bytes: {exc}") from None
        return cls(dtype, layers, layer_bytes, tuple(segs))

    def layout_bytes(self) -> bytes:
        """`to_bytes`, computed once."""
        got = self._cache.get("bytes")
        if got is None:
            got = self._cache["bytes"] = self.to_bytes()
        return got

    def digest(self) -> bytes:
        return _native.digest128(self.layout_bytes())

    def block_rows(self) -> np.ndarray:
        """Row offsets in the block of every segment of every layer, layer by
        layer, segments in order (what the native codec tables index)."""
        got = self._cache.get("rows")
        if got is None:
            per_layer = np.concatenate([s.row_offsets() for s in self.segments])
            got = (np.arange(self.num_layers, dtype=np.int64)[:, None] * self.layer_bytes + per_layer).reshape(-1)
            got.flags.writeable = False
            self._cache["rows"] = got
        return got


def segment_floats(block: object, layout: KvLayout, seg: KvSegmentSpec, every: int = 1) -> np.ndarray:
    """Segment `seg` of every layer of one block (any buffer of
    `layout.block_bytes` bytes) as float32 `[layers, heads, tokens,
    channels]` (a copy); with `every` > 1 only every `every`-th token of
    each page, token 0 included (`page_tokens` must divide by it). The
    dtype must be one of FLOAT_DTYPES; strides are bytes, so none needs to
    be whole elements."""
    if layout.dtype not in _READ:
        raise ArgumentError(f"segment_floats reads dtypes {list(FLOAT_DTYPES)}, not {layout.dtype!r}")
    if every <= 0 or seg.page_tokens % every:
        raise ArgumentError(f"segment_floats: every={every!r} does not divide page_tokens {seg.page_tokens}")
    view = memoryview(block).cast("B")  # type: ignore[arg-type]
    if view.nbytes != layout.block_bytes:
        raise ArgumentError(f"block of {view.nbytes} bytes, the layout describes {layout.block_bytes}")
    eb = layout.elem_bytes
    strided = np.ndarray(shape=(layout.num_layers, seg.heads, seg.pages, seg.page_tokens // every, seg.channels),
                         dtype=_READ[layout.dtype], buffer=view, offset=seg.offset,
                         strides=(layout.layer_bytes, seg.head_stride, seg.page_stride, seg.token_stride * every, eb))
    shape = (layout.num_layers, seg.heads, seg.tokens // every, seg.channels)
    if layout.dtype == "bfloat16":
        return (strided.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return strided.astype(np.float32).reshape(shape)


def opaque_layout(block_bytes: int) -> KvLayout:
    """Blocks of `block_bytes` whose K/V order the connector does not
    describe (SGLang's host pages, vLLM's device pages). Registering it
    makes that size unreadable to the quantising codecs: alone, its bytes
    are no float type they read; beside a real layout of the same size,
    the size has two layouts and a codec tier stores its blocks raw."""
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
        raise ArgumentError(f"opaque_layout: block_bytes must be an int > 0, got {block_bytes!r}")
    return KvLayout("uint8", 1, block_bytes, (KvSegmentSpec("k", 0, 1, 0, 1, 0, 1, 0, block_bytes),))


def planar_layout(dtype: str, num_layers: int, heads: int, tokens: int, channels: int) -> KvLayout:
    """Per layer K then V, each `[heads, tokens, channels]` contiguous (the
    transformers connector's payload, `LKVHTD`)."""
    eb = ELEM_BYTES[dtype]
    seg = heads * tokens * channels * eb
    return KvLayout(dtype, num_layers, 2 * seg, tuple(
        KvSegmentSpec(kind, i * seg, heads, tokens * channels * eb, 1, 0, tokens, channels * eb, channels)
        for i, kind in enumerate(("k", "v"))))


def paged_head_major_layout(dtype: str, num_layers: int, heads: int, pages: int, page_tokens: int,
                            channels: int) -> KvLayout:
    """vLLM's CPU backend (`LBHNC`): a layer's part of a block is its pages
    in order; a page is `[heads, 2 * page_tokens, channels]`: per head all K
    of the page's tokens, then all V."""
    eb = ELEM_BYTES[dtype]
    row = channels * eb
    head = 2 * page_tokens * row
    page = heads * head
    return KvLayout(dtype, num_layers, pages * page, tuple(
        KvSegmentSpec(kind, i * page_tokens * row, heads, head, pages, page, page_tokens, row, channels)
        for i, kind in enumerate(("k", "v"))))


class LayoutBook:
    """The KV layouts registered with one cache, by block size."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, set[bytes]] = {}
        self._layouts: dict[bytes, KvLayout] = {}

    def register(self, layout: KvLayout) -> None:
        if not isinstance(layout, KvLayout):
            raise ArgumentError(f"register_layout: expected a KvLayout, got {type(layout).__name__}")
        d = layout.digest()
        with self._lock:
            self._layouts[d] = layout
            self._by_size.setdefault(layout.block_bytes, set()).add(d)

    def for_size(self, size: int) -> Optional[KvLayout]:
        """The one layout registered for blocks of `size` bytes, or None
        (none registered, or several: which one a block has is unknown)."""
        with self._lock:
            ds = self._by_size.get(size)
            return self._layouts[next(iter(ds))] if ds and len(ds) == 1 else None

    def layouts(self) -> list[KvLayout]:
        with self._lock:
            return list(self._layouts.values())
