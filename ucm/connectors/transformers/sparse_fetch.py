"""Reads the selected pages of one layer out of ucm, and counts the bytes.

Sparse decode (sparse.py) attends, per layer, over the resident tokens
(sink, local window, tail) and the pages its selector picked. The picked
pages' K and V are read here from the cache the connector stores blocks in:
`CacheAPI.read_slots` leases each block holding a picked page (zero-copy in
the landing tier's shared slots; a block held only below it, on NVMe, is
staged into the landing tier first, whole), and the fill copies out of the
slot only this layer's K and V of the picked pages (per KV head, one
`page_tokens x head_dim` span each of K and V; one native copy call for all
of them).

Granularity. The CacheAPI has no sub-block range read: a lease is of a
whole block and a staging from NVMe reads a whole block (the adapters'
`get_range` sits below the API). So the bytes copied out of the landing
tier are exactly the picked pages of one layer, while the bytes read from a
tier below it are whole blocks. Both are counted (`FetchCounters`):

- `bytes_read[landing]`: bytes copied out of the landing tier's slots (the
  picked pages' K and V of the layer), per fetch;
- `bytes_read[tier]` for a block located below the landing tier when read:
  its whole size (what that tier served to stage it; the nvme adapter's
  own `bytes_read` counter moves by the same amount when the block is read
  from the medium, not when it is still in the adapter's write buffer);
- `bytes_leased`: the size of every block leased (what the cache counts in
  its `bytes_loaded`).

The tier of a block is `CacheAPI.locate` just before the read (in process,
nothing else moves blocks between the two calls in the tests; a concurrent
demotion may move one in between, then its bytes are counted in the tier
it was located in).

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

from ucm import _native
from ucm.api import CacheAPI, Key, Outcome
from ucm.connectors.transformers.kv_copy import byte_view
from ucm.connectors.transformers.namespace import BlockLayout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchCounters:
    fetches: int = 0  # read_slots calls
    blocks_leased: int = 0
    bytes_leased: int = 0
    pages_copied: int = 0
    failed_fetches: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)  # tier name -> bytes (module docstring)

    def as_dict(self) -> dict[str, Any]:
        return {"fetches": self.fetches, "blocks_leased": self.blocks_leased, "bytes_leased": self.bytes_leased,
                "pages_copied": self.pages_copied, "failed_fetches": self.failed_fetches,
                "bytes_read": dict(self.bytes_read)}


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
                 keys: Sequence[Key], request_id: Optional[str], landing: str = "dram") -> None:
        if layout.block_tokens % page_tokens:
            raise ValueError(f"page_tokens {page_tokens} must divide block_tokens {layout.block_tokens}")
        self.cache, self.layout, self.dtype = cache, layout, dtype
        self.page_tokens = page_tokens
        self.keys = list(keys)
        self.request_id = request_id
        self.landing = landing
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
        # Per picked page: (index of its block in `keys`, byte offset of the page inside a head's K span).
        page_src = [(slot_of[u // per_block], (u % per_block) * pt * tok) for u in units]
        copied = [False] * len(keys)
        kb, vb = byte_view(kf), byte_view(vf)
        span = pt * tok

        def fill(first: int, slots: list, arena: Any) -> None:
            src_k, src_v, dst = [], [], []
            for p, (bi, in_head) in enumerate(page_src):
                i = bi - first
                if not 0 <= i < len(slots) or slots[i] is None:
                    continue
                base = slots[i][0] + layer * lay.layer_bytes + in_head
                for h in range(heads):
                    src_k.append(base + h * lay.block_tokens * tok)
                    src_v.append(base + (heads + h) * lay.block_tokens * tok)
                    dst.append((h * total + p * pt) * tok)
            if dst:
                _native.copy_spans(kb, dst, arena, src_k, span, 1)
                _native.copy_spans(vb, dst, arena, src_v, span, 1)
            for i, s in enumerate(slots):
                if s is not None:
                    copied[first + i] = True

        c = self.counters
        try:
            tiers = self.cache.locate(keys)
            out = self.cache.read_slots(keys, [lay.block_bytes] * len(keys), fill, request_id=self.request_id)
        except Exception:
            log.debug("sparse fetch: read_slots raised", exc_info=True)
            c.failed_fetches += 1
            return None
        c.fetches += 1
        done = [o is Outcome.DONE and ok for o, ok in zip(out, copied)]
        # What the cache served is counted whether or not the step may use it.
        for i, o in enumerate(out):
            if o is Outcome.DONE:
                c.blocks_leased += 1
                c.bytes_leased += lay.block_bytes
                t = tiers[i]
                if t is not None and t != self.landing:
                    c.bytes_read[t] = c.bytes_read.get(t, 0) + lay.block_bytes
        if not all(done):
            c.failed_fetches += 1
            return None
        c.pages_copied += len(units)
        c.bytes_read[self.landing] = c.bytes_read.get(self.landing, 0) + 2 * heads * total * tok
        return FetchedPages(units, positions, kf, vf)

