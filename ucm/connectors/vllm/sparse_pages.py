"""Sparse decode over vLLM's paged KV, the part that knows no vLLM: page
summaries of one layer's KV blocks kept up to date from the writes, the
selected tokens gathered out of the pages, and attention over them.

Layout. Everything here reads logical views `[num_blocks, kv_heads,
block_tokens, head_dim]` of one layer's keys and values (token t of a
sequence lies in block `block_row[t // block_tokens]` at offset `t %
block_tokens`). `vec_kv_views` makes them for vLLM's CPU backend with the
`vec` kernel (AVX2 / AVX-512 without AMX, block sizes a multiple of 32):
its layer tensor is `[num_blocks, kv_heads, block_tokens, 2 * head_dim]`
and, per block and head, `cpu_attn_reshape_and_cache` writes the keys
channel-major (`[head_dim, block_tokens]`) and then the values token-major
(`[block_tokens, head_dim]`); other kernels (AMX, NEON, vec16) pack them
differently and are not read here. A page is `page_tokens` consecutive
tokens inside a block (16 by default, Quest's page: 8 pages in a 128-token
CPU block).

`PageSummaries` keeps, per physical block and page, what the selector
reads of the page's keys (`Selector.needs_*`): the per-channel min and
max (`quest`, `moment`, `blend`, `hybrid`), float16 rounded outwards as
the transformers path keeps them (summaries.store_bounds), the mean
(`mean`, `moment`, `blend`), float32, with a stale flag per page. Every
write vLLM makes through the layer (`mark_written(slot_mapping)`) marks its page
stale, and so does the caller for pages written behind the layer's back (a
prefill's context: a prefix-cache hit or a KV connector's load); a stale
page is summarised again from the KV cache the next time a decode row
reads its summary, so a page is read once per change, not once per step.
Cost: 2 bytes x kv_heads x head_dim per page for each of min and max, 4
for the mean: 1.6 % of a float32 KV cache each bound and 3.1 % the mean
at 16-token pages (3.1 % and 6.25 % of a bfloat16 one). For `lowrank`
and `hybrid`, once the layer has a basis (`set_basis`: `[kv_heads,
head_dim, rank]`, fitted by the backend on the first context it decodes
sparsely), every token's key projected on it, float16 as the transformers
path keeps them (lowrank.store_projections), `rank x 2` bytes per token
and head (6.25 % of a float32 KV cache at rank 16), refreshed when the
page is; setting the basis marks every page stale, so no projection made
with another basis is ever read.

Runs in the worker's model thread; no lock (each layer owns its
summaries).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ucm.accelerators.sparse import BOUND_DTYPE, PROJ_DTYPE, UnitSummaries, store_bounds, store_projections
from ucm.errors import ArgumentError


class PageSummaries:
    """One layer's key summaries per page of every KV block (module docstring)."""

    def __init__(self, num_blocks: int, kv_heads: int, block_tokens: int, head_dim: int, page_tokens: int = 16,
                 keep_bounds: bool = True, keep_mean: bool = False) -> None:
        if page_tokens <= 0 or block_tokens % page_tokens:
            raise ArgumentError(f"PageSummaries: page_tokens {page_tokens} must divide block_tokens {block_tokens}")
        self.num_blocks, self.kv_heads, self.head_dim = num_blocks, kv_heads, head_dim
        self.block_tokens, self.page_tokens = block_tokens, page_tokens
        self.pages_per_block = block_tokens // page_tokens
        shape = (num_blocks, kv_heads, self.pages_per_block, head_dim)
        bound = getattr(torch, BOUND_DTYPE.name)
        self.min: Optional[torch.Tensor] = torch.zeros(shape, dtype=bound) if keep_bounds else None
        self.max: Optional[torch.Tensor] = torch.zeros(shape, dtype=bound) if keep_bounds else None
        self.mean: Optional[torch.Tensor] = torch.zeros(shape, dtype=torch.float32) if keep_mean else None
        self.stale = torch.ones((num_blocks, self.pages_per_block), dtype=torch.bool)
        self.writes = torch.zeros((num_blocks, self.pages_per_block), dtype=torch.int64)  # marks per page, ever
        self.pages_summarized = 0
        self.basis: Optional[np.ndarray] = None  # [kv_heads, head_dim, rank] float32, for `lowrank`
        # [num_blocks, kv_heads, pages, page_tokens, rank] float16, with a basis
        self.proj: Optional[torch.Tensor] = None

    def set_basis(self, basis: np.ndarray) -> None:
        """Keeps every token's key projected on `basis` `[kv_heads,
        head_dim, rank]` from now on; every page is summarised again before
        its summaries are read."""
        if basis.ndim != 3 or basis.shape[:2] != (self.kv_heads, self.head_dim):
            raise ArgumentError(f"PageSummaries.set_basis: basis {basis.shape} is not [{self.kv_heads}, "
                                f"{self.head_dim}, rank]")
        self.basis = np.ascontiguousarray(basis, dtype=np.float32)
        self.proj = torch.zeros((self.num_blocks, self.kv_heads, self.pages_per_block, self.page_tokens,
                                 basis.shape[2]), dtype=getattr(torch, PROJ_DTYPE.name))
        self.stale[:] = True

    def mark_written(self, slot_mapping: torch.Tensor) -> None:
        """Pages holding the slots vLLM just wrote (`block * block_tokens +
        offset`; negative slots are padding) are stale."""
        s = slot_mapping.reshape(-1).to(torch.int64)
        s = s[s >= 0]
        if s.numel():
            b, j = s // self.block_tokens, (s % self.block_tokens) // self.page_tokens
            self.stale[b, j] = True
            self.writes.index_put_((b, j), torch.ones_like(b), accumulate=True)

    def mark_blocks(self, blocks: torch.Tensor) -> None:
        """Every page of `blocks` is stale (written where the layer did not see it)."""
        if blocks.numel():
            b = blocks.to(torch.int64)
            self.stale[b] = True
            self.writes.index_add_(0, b, torch.ones((b.numel(), self.pages_per_block), dtype=torch.int64))

    def units(self, key_cache: torch.Tensor, block_row: torch.Tensor, n_tokens: int) -> UnitSummaries:
        """The summaries of the sequence's full pages (`n_tokens //
        page_tokens` of them, in token order) for a selector, the stale ones
        summarised first from `key_cache`."""
        b, j = self._pages(block_row, n_tokens // self.page_tokens)
        stale = self.stale[b, j]
        if bool(stale.any()):
            self.refresh(key_cache, b[stale], j[stale])

        def part(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
            return t[b, :, j].float().numpy() if t is not None else None  # [pages, kv_heads, head_dim], float32

        proj = None
        if self.proj is not None:  # [pages, kv_heads, page_tokens, rank] -> [kv_heads, tokens, rank], float32
            proj = self.proj[b, :, j].transpose(0, 1).reshape(self.kv_heads, -1, self.proj.shape[4]).float().numpy()
        return UnitSummaries(self.page_tokens, int(b.numel()), part(self.min), part(self.max), part(self.mean),
                             proj, self.basis)

    def refresh(self, key_cache: torch.Tensor, blocks: torch.Tensor, pages: torch.Tensor) -> None:
        """Summarises pages `(blocks[i], pages[i])` from the keys in `key_cache`."""
        keys = key_cache.unflatten(2, (self.pages_per_block, self.page_tokens))[blocks, :, pages].float()
        if self.min is not None and self.max is not None:  # keys: [n, kv_heads, page_tokens, head_dim]
            low, high = store_bounds(keys.amin(dim=2).numpy(), keys.amax(dim=2).numpy())
            self.min[blocks, :, pages] = torch.from_numpy(low)
            self.max[blocks, :, pages] = torch.from_numpy(high)
        if self.mean is not None:
            self.mean[blocks, :, pages] = keys.mean(dim=2)
        if self.proj is not None:
            proj = torch.einsum("nhtd,hdr->nhtr", keys, torch.from_numpy(self.basis)).numpy()
            self.proj[blocks, :, pages] = torch.from_numpy(store_projections(proj))
        self.stale[blocks, pages] = False
        self.pages_summarized += int(blocks.numel())

    def page_writes(self, block_row: torch.Tensor, n_pages: int) -> torch.Tensor:
        """The write marks of a sequence's first `n_pages` pages, in token order."""
        b, j = self._pages(block_row, n_pages)
        return self.writes[b, j]

    def _pages(self, block_row: torch.Tensor, n_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.arange(n_pages, dtype=torch.int64)
        return block_row[p // self.pages_per_block].to(torch.int64), p % self.pages_per_block


@dataclass(frozen=True, slots=True, eq=False)
class _Held:
    forward: int  # the layer forward that selected
    n_tokens: int  # the row's context then
    blocks: torch.Tensor  # the row's block ids over those tokens
    writes: torch.Tensor  # the write marks of their full pages then
    positions: torch.Tensor  # the tokens picked (sink, local, tail, pages), all < n_tokens


class HeldSelections:
    """One layer's selections, each reused for `every` forwards of the
    layer (vLLM runs every layer once per engine step), as the transformers
    path's `reselect_every` does: a decode row whose context grew from
    `n0` to `n` tokens within them attends the tokens picked at `n0` plus
    every token from `n0` on (the tokens decoded meanwhile; the local
    window at `n` lies inside them), with no scoring.

    A selection is found by the block holding the row's last token when it
    was made (`(block id, n0)`; vLLM never shares a block still being
    written) and reused only when exact: the row's blocks over `[0, n0)`
    are the same ids and none of their full pages was written since
    (`PageSummaries.page_writes`), so the held tokens hold the same keys
    and values as when they were picked. Otherwise the row selects again.
    `every = 1`: nothing is held (select at every step). Selections older
    than `every` forwards are dropped at each `tick`."""

    def __init__(self, every: int, block_tokens: int, page_tokens: int) -> None:
        if not isinstance(every, int) or every < 1:
            raise ArgumentError(f"HeldSelections: every must be an int >= 1, got {every!r}")
        self.every, self.block_tokens, self.page_tokens = every, block_tokens, page_tokens
        self.forward = 0
        self._held: dict[tuple[int, int], _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def tick(self) -> None:
        """One forward of the layer: selections made `every` forwards ago expire."""
        self.forward += 1
        if self._held:
            old = [k for k, h in self._held.items() if self.forward - h.forward >= self.every]
            for k in old:
                del self._held[k]

    def find(self, summaries: PageSummaries, block_row: torch.Tensor, n_tokens: int) -> Optional[torch.Tensor]:
        """The positions a row of `n_tokens` attends under a held
        selection, or None (select again)."""
        if self.every == 1:
            return None
        for back in range(1, self.every):
            n0 = n_tokens - back
            if n0 < 1:
                return None
            h = self._held.get((int(block_row[(n0 - 1) // self.block_tokens]), n0))
            if h is None:
                continue
            nb = h.blocks.numel()
            if (block_row.numel() < nb  # (expired ones are gone: `tick` runs first in each forward)
                    or not torch.equal(block_row[:nb].to(torch.int64), h.blocks)
                    or not torch.equal(summaries.page_writes(block_row, n0 // self.page_tokens), h.writes)):
                return None
            return torch.cat([h.positions, torch.arange(n0, n_tokens, dtype=torch.int64)])
        return None

    def keep(self, summaries: PageSummaries, block_row: torch.Tensor, n_tokens: int,
             positions: torch.Tensor) -> None:
        """Holds the selection a row of `n_tokens` just made (`positions`)."""
        if self.every == 1 or n_tokens < 1:
            return
        nb = -(-n_tokens // self.block_tokens)
        self._held[(int(block_row[(n_tokens - 1) // self.block_tokens]), n_tokens)] = _Held(
            self.forward, n_tokens, block_row[:nb].to(torch.int64).clone(),
            summaries.page_writes(block_row, n_tokens // self.page_tokens).clone(), positions)


def vec_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical `[num_blocks, kv_heads, block_tokens, head_dim]` views (no
    copy) of the keys and values in one layer's KV tensor as vLLM's CPU
    `vec` kernel lays them out (module docstring)."""
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or not kv_cache.is_contiguous():
        raise ArgumentError(f"vec_kv_views: expected a contiguous [num_blocks, kv_heads, block_tokens, 2 * head_dim] "
                            f"tensor, got {tuple(kv_cache.shape)}")
    nb, heads, bt, two_d = kv_cache.shape
    d = two_d // 2
    halves = kv_cache.view(nb, heads, 2, bt * d)
    keys = halves[:, :, 0].unflatten(2, (d, bt)).transpose(2, 3)
    values = halves[:, :, 1].unflatten(2, (bt, d))
    return keys, values


def range_positions(ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The token positions of sorted half-open `ranges`, in order (int64)."""
    if not ranges:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])


def gather_tokens(cache: torch.Tensor, block_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The tokens at `positions` of one sequence out of a paged `cache`
    `[num_blocks, kv_heads, block_tokens, head_dim]`: `[n, kv_heads, head_dim]`."""
    bt = cache.shape[2]
    blocks = block_row[positions // bt].to(torch.int64)
    return cache[blocks, :, positions % bt]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of one decode token over the given tokens, in
    float32: `query` `[q_heads, head_dim]`, `keys` / `values` `[n, kv_heads,
    head_dim]` (query head h reads KV head `h // (q_heads // kv_heads)`);
    returns `[q_heads, head_dim_v]` float32."""
    q_heads, dim = query.shape
    kv_heads = keys.shape[1]
    if q_heads % kv_heads:
        raise ArgumentError(f"attend: {q_heads} query heads do not group onto {kv_heads} KV heads")
    q = query.float().reshape(kv_heads, q_heads // kv_heads, dim)
    logits = torch.einsum("hgd,thd->hgt", q, keys.float()) * scale
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("hgt,thd->hgd", probs, values.float()).reshape(q_heads, -1)


def context_keys(key_cache: torch.Tensor, block_row: torch.Tensor, n_tokens: int) -> np.ndarray:
    """Every key of a sequence, `[kv_heads, n_tokens, head_dim]` float32
    (for the `oracle` selector, which reads them all)."""
    k = gather_tokens(key_cache, block_row, torch.arange(n_tokens, dtype=torch.int64))
    return k.float().transpose(0, 1).contiguous().numpy()
