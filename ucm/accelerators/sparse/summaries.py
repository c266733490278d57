"""Block summaries: what selection knows of a block's keys without its KV.

A summary is computed once from a block's bytes through the `KvLayout` its
connector registered (ucm/codecs/layout.py): for every layer and KV head,
per page of `page_tokens` consecutive tokens (16 by default, Quest's page)
the per-channel minimum and maximum of the keys (Quest's bounds) and their
mean (UCM's ESA/GSA baseline keeps one mean key per block); the `moment`
selector reads all three (selectors.py). The whole block's min, max and
mean are reductions of the pages' (pages hold the same number of tokens),
computed when asked, not stored.

Keys are read as float32, whatever the block's dtype (float32, float16
and bfloat16 are read; bfloat16 without a numpy extension: its 16 bits
are the top half of a float32). The bounds are kept as float16 rounded
outwards (`store_bounds`: min down, max up, so a kept bound still bounds
every key of its page; beyond float16's finite range clamped to it, as
projections are), the mean as float32. Pure numpy, vectorised over
layers, heads and tokens; runs in the caller's thread.

What a summary keeps is what its selector reads (`SummaryParts.of`):
the bounds (min and max: quest, moment, blend, hybrid), the mean (mean,
moment, blend), and with a `KeyBasis` (lowrank.py) every token's projected
key, `[layers, kv_heads, tokens, rank]` float16 (`lowrank`, `hybrid`), with the basis's
digest. `layer_units` hands a part to the selectors only when every block
keeps it (projections: made with the basis asked for).

Cost, per block (`summary_nbytes`, `BlockSummary.nbytes`): `layers x
kv_heads x (pages x head_dim x (2 x 2 for the bounds + 4 for the mean) +
tokens x rank x 2)` bytes. Against a bfloat16 block's K and V at 16-token
pages that is 1/16 for the float16 bounds, 1/16 for the mean, and
rank / (2 x head_dim) for the projections (1/8 at rank 16 and head size
64); whole-block pages cut the page parts by the pages per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ucm.accelerators.sparse.base import Selector, UnitSummaries
from ucm.accelerators.sparse.lowrank import PROJ_DTYPE, KeyBasis, store_projections
from ucm.codecs.layout import FLOAT_DTYPES, KvLayout, KvSegmentSpec, segment_floats
from ucm.errors import ArgumentError

BOUND_DTYPE = np.dtype(np.float16)  # how summaries keep the key bounds
_BOUND_MAX = float(np.finfo(np.float16).max)

SUMMARY_DTYPES = FLOAT_DTYPES  # what summaries read (segment_floats)


@dataclass(frozen=True, slots=True)
class SummaryParts:
    """Which page summaries to keep: `bounds` (per-channel min and max),
    `mean`. Projections come with a basis, whatever the parts."""

    bounds: bool = True
    mean: bool = True

    @classmethod
    def of(cls, selector: Selector) -> "SummaryParts":
        """What `selector` reads (its `needs_bounds`, `needs_mean`)."""
        return cls(bounds=selector.needs_bounds, mean=selector.needs_mean)


@dataclass(frozen=True, slots=True, eq=False)
class BlockSummary:
    """One block's key summaries: the page parts kept (`page_min`,
    `page_max`, `page_mean`: `[layers, kv_heads, pages, head_dim]`,
    BOUND_DTYPE bounds and a float32 mean, page p covering tokens `[p *
    page_tokens, (p + 1) * page_tokens)`; None when not kept) and, with a basis, the projected
    keys. `keys_shape` is the summarised keys' `[layers, kv_heads,
    block_tokens, head_dim]`."""

    page_tokens: int
    keys_shape: tuple[int, int, int, int]
    page_min: Optional[np.ndarray] = None
    page_max: Optional[np.ndarray] = None
    page_mean: Optional[np.ndarray] = None
    proj: Optional[np.ndarray] = None  # [layers, kv_heads, block_tokens, rank] PROJ_DTYPE, with a KeyBasis
    basis_digest: bytes = b""  # the KeyBasis.digest `proj` was made with

    def projected_with(self, basis: Optional[KeyBasis]) -> bool:
        """Whether this summary keeps projections made with `basis`."""
        return basis is not None and self.proj is not None and self.basis_digest == basis.digest

    def keeps(self, parts: SummaryParts, basis: Optional[KeyBasis] = None) -> bool:
        """Whether this summary holds every part of `parts` and, when
        `basis` is given, projections made with it."""
        return (not parts.bounds or self.page_min is not None) and (not parts.mean or self.page_mean is not None) \
            and (basis is None or self.projected_with(basis))

    @property
    def num_layers(self) -> int:
        return self.keys_shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys_shape[1]

    @property
    def block_tokens(self) -> int:
        return self.keys_shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys_shape[3]

    @property
    def pages(self) -> int:
        return self.block_tokens // self.page_tokens

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.page_min, self.page_max, self.page_mean, self.proj) if a is not None)

    # The whole block, `[layers, kv_heads, head_dim]` (reductions of the pages': the parts kept).
    @property
    def block_min(self) -> Optional[np.ndarray]:
        return self.page_min.min(axis=2) if self.page_min is not None else None

    @property
    def block_max(self) -> Optional[np.ndarray]:
        return self.page_max.max(axis=2) if self.page_max is not None else None

    @property
    def block_mean(self) -> Optional[np.ndarray]:
        return self.page_mean.mean(axis=2, dtype=np.float32) if self.page_mean is not None else None


def store_bounds(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Key bounds as summaries keep them: float16 rounded outwards, `low`
    down and `high` up, so every key a float32 bound covers the kept one
    covers too (Quest's bound stays an upper bound of q . k); values beyond
    float16's finite range clamped to it (never an inf, whose product with
    a zero query channel is NaN)."""
    lo32 = np.clip(np.asarray(low, dtype=np.float32), -_BOUND_MAX, _BOUND_MAX)
    hi32 = np.clip(np.asarray(high, dtype=np.float32), -_BOUND_MAX, _BOUND_MAX)
    lo, hi = lo32.astype(BOUND_DTYPE), hi32.astype(BOUND_DTYPE)
    with np.errstate(over="ignore"):  # the step past +-_BOUND_MAX is computed, never chosen: those are exact
        lo = np.where(lo.astype(np.float32) > lo32, np.nextafter(lo, BOUND_DTYPE.type(-np.inf)), lo)
        hi = np.where(hi.astype(np.float32) < hi32, np.nextafter(hi, BOUND_DTYPE.type(np.inf)), hi)
    return lo, hi


def summary_nbytes(layout: KvLayout, page_tokens: int, rank: int = 0, parts: SummaryParts = SummaryParts()) -> int:
    """The bytes of one block's summary under `layout`: the page `parts`,
    and projections of `rank` (0: none) (see the module docstring)."""
    k = key_segment(layout)
    check_page_tokens(k.tokens, page_tokens)
    page_bytes = 2 * parts.bounds * BOUND_DTYPE.itemsize + parts.mean * 4
    return (page_bytes * (k.tokens // page_tokens) * k.channels + k.tokens * rank * PROJ_DTYPE.itemsize) \
        * layout.num_layers * k.heads


def key_segment(layout: KvLayout) -> KvSegmentSpec:
    """The one K segment of `layout`'s layers; ArgumentError for a layout
    whose keys summaries cannot read (a dtype other than float32, float16,
    bfloat16; no or several K segments; strides not whole elements)."""
    if layout.dtype not in SUMMARY_DTYPES:
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
    return segment_floats(block, layout, key_segment(layout))


def summarize_keys(keys: np.ndarray, page_tokens: int = 16, basis: Optional[KeyBasis] = None,
                   parts: SummaryParts = SummaryParts()) -> BlockSummary:
    """The summary of keys `[layers, kv_heads, block_tokens, head_dim]`:
    the page `parts`, and their projections when a `basis` is given."""
    keys = np.asarray(keys, dtype=np.float32)
    if keys.ndim != 4:
        raise ArgumentError(f"summarize_keys: keys must be [layers, kv_heads, tokens, head_dim], got {keys.shape}")
    layers, heads, tokens, dim = keys.shape
    check_page_tokens(tokens, page_tokens)
    pages = keys.reshape(layers, heads, tokens // page_tokens, page_tokens, dim)
    low, high = store_bounds(pages.min(axis=3), pages.max(axis=3)) if parts.bounds else (None, None)
    return BlockSummary(page_tokens, (layers, heads, tokens, dim), low, high,
                        pages.mean(axis=3, dtype=np.float32) if parts.mean else None,
                        store_projections(basis.project(keys)) if basis is not None else None,
                        basis.digest if basis is not None else b"")


def summarize(block: object, layout: KvLayout, page_tokens: int = 16, basis: Optional[KeyBasis] = None,
              parts: SummaryParts = SummaryParts()) -> BlockSummary:
    """The summary of one block's bytes under `layout` (see the module docstring)."""
    return summarize_keys(block_keys(block, layout), page_tokens, basis, parts)


def layer_units(blocks: Sequence[BlockSummary], layer: int, unit_tokens: int,
                basis: Optional[KeyBasis] = None) -> UnitSummaries:
    """One layer's summaries of consecutive blocks at units of
    `unit_tokens` (a multiple of their page size dividing their tokens: a
    page, several, or the whole block), in token order: each page part
    that every block keeps (else None), and the blocks' projected keys
    (float32) with the layer's basis when `basis` is given and every block
    was projected with it (otherwise none: `lowrank` cannot score)."""
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

    def units(part: str, reduce: Any) -> Optional[np.ndarray]:
        arrays = [getattr(b, part) for b in blocks]
        if any(a is None for a in arrays):
            return None
        x = np.stack([a[layer] for a in arrays]).reshape(len(arrays), heads, bt // unit_tokens, r, dim)
        x = reduce(x, axis=3)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(-1, heads, dim), dtype=np.float32)

    proj = lbasis = None
    if basis is not None and all(b.projected_with(basis) for b in blocks):
        proj = np.concatenate([b.proj[layer] for b in blocks], axis=1).astype(np.float32)  # type: ignore[index]
        lbasis = basis.vectors[layer]
    return UnitSummaries(unit_tokens, len(blocks) * (bt // unit_tokens), units("page_min", np.min),
                         units("page_max", np.max), units("page_mean", np.mean), proj, lbasis)


def units_from_keys(keys: np.ndarray, unit_tokens: int, basis: Optional[np.ndarray] = None) -> UnitSummaries:
    """One layer's summaries straight from its keys `[kv_heads, n_tokens,
    head_dim]`, for the `n_tokens // unit_tokens` full units, as stored
    summaries give them: every page part (the bounds rounded as they are
    kept, `store_bounds`), and with the layer's `basis` `[kv_heads,
    head_dim, rank]` the projections rounded as they are kept
    (`store_projections`), as float32."""
    heads, n, dim = keys.shape
    full = n // unit_tokens
    x = np.asarray(keys[:, :full * unit_tokens], dtype=np.float32).reshape(heads, full, unit_tokens, dim)
    proj = None
    if basis is not None:
        exact = np.einsum("htd,hdr->htr", x.reshape(heads, -1, dim), basis, optimize=True)
        proj = store_projections(exact).astype(np.float32)
    x = x.transpose(1, 0, 2, 3)
    low, high = store_bounds(x.min(axis=2), x.max(axis=2))
    return UnitSummaries(unit_tokens, full, low.astype(np.float32), high.astype(np.float32),
                         np.ascontiguousarray(x.mean(axis=2, dtype=np.float32)), proj, basis)
