"""Reads the selected pages of one layer out of ucm, and counts the bytes.

Sparse decode (sparse.py) attends, per layer, over the resident tokens
(sink, local window, tail) and the pages its selector picked. The picked
pages' K and V are read here from the cache the connector stores blocks in,
by `CacheAPI.read_ranges`: per picked page and KV head, one
`page_tokens x head_dim` span of K and one of V of this layer, copied
straight into the attention's K and V tensors. The cache reads them where
the blocks are and stages nothing: out of the landing tier's slots, and
from a tier below it range by range (nvme reads the verified chunks that
cover the spans; ucm/cache/ranges.py). Through the service (CacheClient)
a block below the landing tier is staged whole, and counted whole.

Counted (`FetchCounters`): `bytes_read[tier]`, the bytes each tier
delivered for the fetches (RangeRead.bytes: the spans' bytes; a whole
block where it was staged), equal to the cache's own per-tier
`range_bytes`; a tier's medium may read more (nvme's `bytes_read` counts
whole verified chunks); `blocks_read`, the blocks read.

Faults are values: `fetch_pages` returns None when any block is not DONE
(evicted, corrupt, failed, service gone) or the call raised; the caller
then attends densely for that step. Runs in the caller's (the model's)
thread; no lock (one `PageFetcher` per decode session).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ucm.api import CacheAPI, Key, Outcome
from ucm.connectors.transformers.kv_copy import byte_view
from ucm.connectors.transformers.namespace import BlockLayout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchCounters:
    fetches: int = 0  # read_ranges calls
    blocks_read: int = 0
    pages_copied: int = 0
    failed_fetches: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)  # tier name -> bytes (module docstring)

    def as_dict(self) -> dict[str, Any]:
        return {"fetches": self.fetches, "blocks_read": self.blocks_read, "pages_copied": self.pages_copied,
                "failed_fetches": self.failed_fetches, "bytes_read": dict(self.bytes_read)}


@dataclass(frozen=True, slots=True, eq=False)
class FetchedPages:
    """One layer's picked pages: `keys` / `values` `[kv_heads, pages *
    page_tokens, head_dim]` in the order of `units`, whose tokens are
    `positions` (sequence positions, ascending)."""

    units: tuple[int, ...]
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class PageFetcher:
    """Fetches pages (units of `page_tokens` tokens inside the blocks of
    `layout`) of one row's prefix blocks `keys` from `cache`."""

    def __init__(self, cache: CacheAPI, layout: BlockLayout, dtype: torch.dtype, page_tokens: int,
                 keys: Sequence[Key], request_id: Optional[str]) -> None:
        if layout.block_tokens % page_tokens:
            raise ValueError(f"page_tokens {page_tokens} must divide block_tokens {layout.block_tokens}")
        self.cache, self.layout, self.dtype = cache, layout, dtype
        self.page_tokens = page_tokens
        self.keys = list(keys)
        self.request_id = request_id
        self.counters = FetchCounters()

    def fetch_pages(self, layer: int, units: Sequence[int], pad: int = 0) -> Optional[FetchedPages]:
        """Layer `layer`'s K and V of pages `units` (page u covers the row's
        tokens `[u * page_tokens, (u + 1) * page_tokens)`, at sequence
        positions shifted by `pad`), or None when a block could not be read."""
        lay, pt = self.layout, self.page_tokens
        units = tuple(sorted(int(u) for u in units))
        per_block = lay.block_tokens // pt
        blocks = sorted({u // per_block for u in units})
        if blocks and blocks[-1] >= len(self.keys):
            log.debug("sparse fetch: page %d lies past the %d stored blocks", units[-1], len(self.keys))
            return None
        item = torch.empty((), dtype=self.dtype).element_size()
        tok = lay.head_dim * item
        heads, total = lay.num_kv_heads, len(units) * pt
        kf = torch.empty((heads, total, lay.head_dim), dtype=self.dtype)
        vf = torch.empty((heads, total, lay.head_dim), dtype=self.dtype)
        positions = torch.tensor([pad + u * pt + t for u in units for t in range(pt)], dtype=torch.int64)
        if not units:
            return FetchedPages(units, positions, kf, vf)
        keys = [self.keys[j] for j in blocks]
        slot_of = {j: i for i, j in enumerate(blocks)}
        kb, vb = byte_view(kf), byte_view(vf)
        span = pt * tok
        # Per block: the offsets of its picked pages' spans (K and V per head)
        # and the matching slices of kf / vf they land in.
        offsets: list[list[int]] = [[] for _ in keys]
        dsts: list[list[memoryview]] = [[] for _ in keys]
        for p, u in enumerate(units):
            i = slot_of[u // per_block]
            base = layer * lay.layer_bytes + (u % per_block) * span
            for h in range(heads):
                at = (h * total + p * pt) * tok
                offsets[i] += [base + h * lay.block_tokens * tok, base + (heads + h) * lay.block_tokens * tok]
                dsts[i] += [kb[at:at + span], vb[at:at + span]]
        c = self.counters
        try:
            out = self.cache.read_ranges(keys, offsets, dsts, request_id=self.request_id)
        except Exception:
            log.debug("sparse fetch: read_ranges raised", exc_info=True)
            c.failed_fetches += 1
            return None
        c.fetches += 1
        # What the tiers served is counted whether or not the step may use it.
        for r in out:
            if r.outcome is Outcome.DONE:
                c.blocks_read += 1
                c.bytes_read[r.tier] = c.bytes_read.get(r.tier, 0) + r.bytes
        if not all(r.outcome is Outcome.DONE for r in out):
            c.failed_fetches += 1
            return None
        c.pages_copied += len(units)
        return FetchedPages(units, positions, kf, vf)


def reuse_pages(held: FetchedPages, fresh: FetchedPages, units: Any, page_tokens: int) -> FetchedPages:
    """The pages `units` (sorted, as `fetch_pages` orders them), each taken
    from `held` when it holds it, else from `fresh`: K, V and positions
    gathered per page along the token axis."""
    units = tuple(sorted(int(u) for u in units))
    at_held = {u: i for i, u in enumerate(held.units)}
    at_fresh = {u: len(held.units) + i for i, u in enumerate(fresh.units)}
    slots = [at_held[u] if u in at_held else at_fresh[u] for u in units]
    idx = (torch.tensor(slots, dtype=torch.int64).unsqueeze(1) * page_tokens
           + torch.arange(page_tokens, dtype=torch.int64)).reshape(-1)
    keys = torch.cat([held.keys, fresh.keys], dim=1).index_select(1, idx)
    values = torch.cat([held.values, fresh.values], dim=1).index_select(1, idx)
    positions = torch.cat([held.positions, fresh.positions]).index_select(0, idx)
    return FetchedPages(units, positions, keys, values)
