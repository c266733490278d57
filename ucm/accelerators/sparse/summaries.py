"""Block summaries: what selection knows of a block's keys without its KV.

A summary is computed once from a block's bytes through the `KvLayout` its
connector registered (ucm/codecs/layout.py): for every layer and KV head,
per page of `page_tokens` consecutive tokens (16 by default, Quest's page)
the per-channel minimum and maximum of the keys (Quest's bounds) and their
mean (UCM's ESA/GSA baseline keeps one mean key per block); the `moment`
selector reads all three (selectors.py). The whole block's min, max and
mean are reductions of the pages' (pages hold the same number of tokens),
computed when asked, not stored.

Everything is float32, whatever the block's dtype (float32, float16 and
bfloat16 are read; bfloat16 without a numpy extension: its 16 bits are the
top half of a float32). Pure numpy, vectorised over layers, heads and
tokens; runs in the caller's thread.

Cost, per block: `3 x layers x kv_heads x pages x head_dim x 4` bytes
(`BlockSummary.nbytes`). For the transformers connector's SmolLM2 block
(30 layers, 3 KV heads, head size 64, 128 tokens in bfloat16: 2,949,120
bytes) at 16-token pages that is 552,960 bytes, 18.75 % of the block (the
min and max alone 12.5 %); at whole-block pages (`page_tokens` = 128) 2.3 %.

With a `KeyBasis` (lowrank.py) a summary also keeps every token's
projected key, `[layers, kv_heads, tokens, rank]` float32 (`rank x 4`
bytes per token, layer and head: 737,280 bytes, 25 % of the SmolLM2
block, at the default rank 16; 6.25 % at rank 4), and the basis's digest; `layer_units` hands them to
the selectors only when every block was projected with the basis asked
for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ucm.accelerators.sparse.base import UnitSummaries
from ucm.accelerators.sparse.lowrank import KeyBasis
from ucm.codecs.layout import KvLayout, KvSegmentSpec
from ucm.errors import ArgumentError

# How the bytes of each dtype read before they become float32.
_RAW = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
SUMMARY_DTYPES = tuple(sorted(_RAW))


@dataclass(frozen=True, slots=True, eq=False)
class BlockSummary:
    """One block's key summaries, each `[layers, kv_heads, pages,
    head_dim]` float32 (page p covers tokens `[p * page_tokens, (p + 1) *
    page_tokens)` of the block)."""

    page_tokens: int
    page_min: np.ndarray
    page_max: np.ndarray
    page_mean: np.ndarray
    proj: Optional[np.ndarray] = None  # [layers, kv_heads, block_tokens, rank], with a KeyBasis
    basis_digest: bytes = b""  # the KeyBasis.digest `proj` was made with

    def projected_with(self, basis: Optional[KeyBasis]) -> bool:
        """Whether this summary keeps projections made with `basis`."""
        return basis is not None and self.proj is not None and self.basis_digest == basis.digest

    @property
    def num_layers(self) -> int:
        return self.page_min.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.page_min.shape[1]

    @property
    def pages(self) -> int:
        return self.page_min.shape[2]

    @property
    def head_dim(self) -> int:
        return self.page_min.shape[3]

    @property
    def block_tokens(self) -> int:
        return self.pages * self.page_tokens

    @property
    def nbytes(self) -> int:
        return self.page_min.nbytes + self.page_max.nbytes + self.page_mean.nbytes + \
            (self.proj.nbytes if self.proj is not None else 0)

    # The whole block, `[layers, kv_heads, head_dim]`.
    @property
    def block_min(self) -> np.ndarray:
        return self.page_min.min(axis=2)

    @property
    def block_max(self) -> np.ndarray:
        return self.page_max.max(axis=2)

    @property
    def block_mean(self) -> np.ndarray:
        return self.page_mean.mean(axis=2, dtype=np.float32)


def summary_nbytes(layout: KvLayout, page_tokens: int, rank: int = 0) -> int:
    """The bytes of one block's summary under `layout`, with projections
    of `rank` (0: none) (see the module docstring)."""
    k = key_segment(layout)
    check_page_tokens(k.tokens, page_tokens)
    return (3 * (k.tokens // page_tokens) * k.channels + k.tokens * rank) * layout.num_layers * k.heads * 4


def key_segment(layout: KvLayout) -> KvSegmentSpec:
    """The one K segment of `layout`'s layers; ArgumentError for a layout
    whose keys summaries cannot read (a dtype other than float32, float16,
    bfloat16; no or several K segments; strides not whole elements)."""
    if layout.dtype not in _RAW:
        raise ArgumentError(f"block summaries read dtypes {list(SUMMARY_DTYPES)}, not {layout.dtype!r}")
    ks = [s for s in layout.segments if s.kind == "k"]
    if len(ks) != 1:
        raise ArgumentError(f"block summaries need one K segment per layer, the layout has {len(ks)}")
    k = ks[0]
    eb = layout.elem_bytes
    if any(x % eb for x in (layout.layer_bytes, k.offset, k.head_stride, k.page_stride, k.token_stride)):
        raise ArgumentError(f"block summaries need K strides in whole {eb}-byte elements, got {k}")
    return k


def check_page_tokens(block_tokens: int, page_tokens: int) -> None:
    if not isinstance(page_tokens, int) or isinstance(page_tokens, bool) or page_tokens <= 0 \
            or block_tokens % page_tokens:
        raise ArgumentError(f"page_tokens must be an int > 0 dividing the block's {block_tokens} tokens, "
                            f"got {page_tokens!r}")


def block_keys(block: object, layout: KvLayout) -> np.ndarray:
    """The keys of one block, `[layers, kv_heads, block_tokens, head_dim]`
    float32 (a copy), read from its bytes (any buffer of
    `layout.block_bytes` bytes) through `layout`."""
    k = key_segment(layout)
    view = memoryview(block).cast("B")  # type: ignore[arg-type]
    if view.nbytes != layout.block_bytes:
        raise ArgumentError(f"block of {view.nbytes} bytes, the layout describes {layout.block_bytes}")
    raw = _RAW[layout.dtype]
    eb = layout.elem_bytes
    strided = np.ndarray(shape=(layout.num_layers, k.heads, k.pages, k.page_tokens, k.channels), dtype=raw,
                         buffer=view, offset=k.offset,
                         strides=(layout.layer_bytes, k.head_stride, k.page_stride, k.token_stride, eb))
    shape = (layout.num_layers, k.heads, k.tokens, k.channels)
    if layout.dtype == "bfloat16":
        return (strided.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return strided.astype(np.float32).reshape(shape)


def summarize_keys(keys: np.ndarray, page_tokens: int = 16, basis: Optional[KeyBasis] = None) -> BlockSummary:
    """The summary of keys `[layers, kv_heads, block_tokens, head_dim]`,
    with their projections when a `basis` is given."""
    keys = np.asarray(keys, dtype=np.float32)
    if keys.ndim != 4:
        raise ArgumentError(f"summarize_keys: keys must be [layers, kv_heads, tokens, head_dim], got {keys.shape}")
    layers, heads, tokens, dim = keys.shape
    check_page_tokens(tokens, page_tokens)
    pages = keys.reshape(layers, heads, tokens // page_tokens, page_tokens, dim)
    proj = basis.project(keys) if basis is not None else None
    return BlockSummary(page_tokens, pages.min(axis=3), pages.max(axis=3), pages.mean(axis=3, dtype=np.float32),
                        proj, basis.digest if basis is not None else b"")


def summarize(block: object, layout: KvLayout, page_tokens: int = 16,
              basis: Optional[KeyBasis] = None) -> BlockSummary:
    """The summary of one block's bytes under `layout` (see the module docstring)."""
    return summarize_keys(block_keys(block, layout), page_tokens, basis)


def layer_units(blocks: Sequence[BlockSummary], layer: int, unit_tokens: int,
                basis: Optional[KeyBasis] = None) -> UnitSummaries:
    """One layer's summaries of consecutive blocks at units of
    `unit_tokens` (a multiple of their page size dividing their tokens: a
    page, several, or the whole block), in token order; with the blocks'
    projected keys and the layer's basis when `basis` is given and every
    block was projected with it (otherwise none: `lowrank` cannot score)."""
    if not blocks:
        raise ArgumentError("layer_units: no block summaries")
    first = blocks[0]
    pt, bt = first.page_tokens, first.block_tokens
    if any(b.page_tokens != pt or b.block_tokens != bt for b in blocks):
        raise ArgumentError("layer_units: the blocks' summaries have different page or block sizes")
    if unit_tokens % pt or bt % unit_tokens:
        raise ArgumentError(f"layer_units: unit_tokens must be a multiple of the {pt}-token pages dividing the "
                            f"{bt}-token blocks, got {unit_tokens}")
    r = unit_tokens // pt
    heads, dim = first.num_kv_heads, first.head_dim

    def units(arrays: list[np.ndarray], reduce: Any) -> np.ndarray:
        x = np.stack(arrays).reshape(len(arrays), heads, bt // unit_tokens, r, dim)
        x = reduce(x, axis=3)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(-1, heads, dim), dtype=np.float32)

    proj = lbasis = None
    if basis is not None and all(b.projected_with(basis) for b in blocks):
        proj = np.ascontiguousarray(np.concatenate([b.proj[layer] for b in blocks], axis=1))  # type: ignore[index]
        lbasis = basis.vectors[layer]
    return UnitSummaries(unit_tokens,
                         units([b.page_min[layer] for b in blocks], np.min),
                         units([b.page_max[layer] for b in blocks], np.max),
                         units([b.page_mean[layer] for b in blocks], np.mean), proj, lbasis)


def units_from_keys(keys: np.ndarray, unit_tokens: int, basis: Optional[np.ndarray] = None) -> UnitSummaries:
    """One layer's summaries straight from its keys `[kv_heads, n_tokens,
    head_dim]`, for the `n_tokens // unit_tokens` full units; with their
    projections on the layer's `basis` `[kv_heads, head_dim, rank]` when
    given."""
    heads, n, dim = keys.shape
    full = n // unit_tokens
    x = np.asarray(keys[:, :full * unit_tokens], dtype=np.float32).reshape(heads, full, unit_tokens, dim)
    proj = None
    if basis is not None:
        proj = np.einsum("htd,hdr->htr", x.reshape(heads, -1, dim), basis, optimize=True).astype(np.float32)
    x = x.transpose(1, 0, 2, 3)
    return UnitSummaries(unit_tokens, np.ascontiguousarray(x.min(axis=2)), np.ascontiguousarray(x.max(axis=2)),
                         np.ascontiguousarray(x.mean(axis=2, dtype=np.float32)), proj, basis)
