"""PageKeys: the keys in vLLM for CPU's KV pages, read back as plain
`[tokens, kv_heads, head_size]`.

CPU_ATTN keeps a layer's KV as `[num_pages, kv_heads, page_tokens,
2 * head_size]`, viewed as `[.., kv_heads, 2 * page_tokens, head_size]`:
per head the page's K, then its V. Within a head's K the order of the
elements is the kernel's, and depends on the ISA it picked (packed for its
matrix products). Rather than copy that order, PageKeys learns it from the
attention impl's own write (`do_kv_cache_update`, as `write`): it writes a
scratch page whose keys hold their own token, head and element index
(small integers, exact in every float dtype), and keeps, per (head, token,
element), where that key lands. A layout that is not a permutation of the
keys (a quantized KV cache) is a ModelError.

Used by the blend's `question` selection (blend.py), which needs the
blended keys of every counted layer to weigh the question's attention.
Thread: the caller's.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ucm.errors import ModelError

# write(key [tokens, kv_heads, head_size], value (same), kv_cache [pages, kv_heads, page_tokens, 2 * head_size],
#       slots [tokens] int64): the attention impl's own KV write
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class PageKeys:
    """Reads keys out of CPU_ATTN pages of one layout (module docstring)."""

    def __init__(self, write: Write, kv_heads: int, page_tokens: int, head_size: int, dtype: torch.dtype) -> None:
        self.kv_heads, self.page_tokens, self.head_size, self.dtype = kv_heads, page_tokens, head_size, dtype
        self._where = self._learn(write)  # [kv_heads * page_tokens * head_size]: (h, t, d) -> offset in a page's K

    def read(self, kv_cache: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys at `positions` of a request whose pages are `pages`
        (page i holds positions [i * page_tokens, (i + 1) * page_tokens)),
        `[len(positions), kv_heads, head_size]` in the cache's dtype."""
        pt = self.page_tokens
        index = positions // pt
        used, local = torch.unique(index, return_inverse=True)
        k = self._keys(kv_cache)[pages[used].long()]  # [used, H, pt, D]: a copy of the pages read
        plain = k.reshape(len(used), -1)[:, self._where].view(len(used), self.kv_heads, pt, self.head_size)
        return plain[local, :, positions % pt]

    def _keys(self, kv_cache: torch.Tensor) -> torch.Tensor:
        pages, heads, pt, two_d = kv_cache.shape
        return kv_cache.view(pages, heads, 2 * pt, two_d // 2)[:, :, :pt]

    def _learn(self, write: Write) -> torch.Tensor:
        h, t, d = self.kv_heads, self.page_tokens, self.head_size
        scratch = torch.zeros((1, h, t, 2 * d), dtype=self.dtype)
        slots = torch.arange(t, dtype=torch.long)
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(d), indexing="ij")  # [t, h, d] each
        seen = []
        for coord in grid:  # the token, the head, the element: one write each, small exact integers
            scratch.zero_()
            write(coord.to(self.dtype).contiguous(), torch.zeros((t, h, d), dtype=self.dtype), scratch, slots)
            seen.append(self._keys(scratch).reshape(-1).to(torch.long))
        tok, head, elem = seen
        code = (head * t + tok) * d + elem  # where each element of the page's K came from, as a flat (h, t, d)
        where: Optional[torch.Tensor] = None
        if bool(((tok < t) & (head < h) & (elem < d) & (tok >= 0) & (head >= 0) & (elem >= 0)).all()):
            where = torch.empty_like(code).fill_(-1)
            where[code] = torch.arange(len(code))
        if where is None or bool((where < 0).any()):
            raise ModelError("blend: the attention impl's key pages are not a permutation of the keys "
                             "(a quantized KV cache?); the question's selection cannot read them")
        return where
