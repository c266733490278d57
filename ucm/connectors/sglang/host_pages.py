"""HostPageCopier: whole SGLang pages copied straight between an MHA host
pool (`MHATokenToKVPoolHost.kv_buffer`) and ucm arena slots, no staging
buffer.

Where a page lies comes from SGLang itself: `get_page_buffer_meta(indices)`
gives, per page, the pointers and sizes of its buffers, in an order fixed by
the layout (`layer_first`: K and V of layer 0, of layer 1, ...: 2 x layers
buffers; `page_first` and `page_first_direct`: the page's K, then its V, all
layers each). A page's payload in its slot is those buffers back to back in
that order, verbatim (K and V are never re-interpreted); the layout is in
the namespace, so payloads of different layouts never meet. All the spans of
one call are moved by one native call (`_native.copy_spans`, bounds
checked, GIL released).

Thread-safe: it holds the pool's storage and its geometry, nothing that a
copy changes. Runs in SGLang's prefetch and backup threads."""
from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import torch

from ucm import _native
from ucm.errors import ConfigError


class HostPageCopier:
    """Copies pages between one SGLang host pool and arena slots."""

    def __init__(self, pool: Any, threads: int = 1) -> None:
        buf = pool.kv_buffer
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            raise ConfigError(f"UCMStorage: the host pool's kv_buffer must be one contiguous CPU tensor, got "
                              f"{type(buf).__name__} {getattr(buf, 'device', '?')}")
        self._pool = pool
        self._tensor = buf  # keeps the storage alive under the view below
        self._flat = buf.view(-1).view(torch.uint8).numpy()  # the same memory, as bytes
        self._base = buf.data_ptr()
        self.page_size = int(pool.page_size)
        self._threads = max(1, int(threads))
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs or len(set(sizes)) != 1:
            raise ConfigError(f"UCMStorage: the host pool's pages are {len(ptrs)} buffers of sizes "
                              f"{sorted(set(sizes))}; ucm copies pages made of equal buffers")
        self.buffers_per_page = len(ptrs)
        self.buffer_bytes = int(sizes[0])
        self.page_bytes = self.buffers_per_page * self.buffer_bytes
        self._spent_lock = threading.Lock()
        self._spent_s = 0.0

    @property
    def copy_seconds(self) -> float:
        """Seconds spent in `copy` so far, over every thread (what a bench
        compares with a memcpy of the same bytes)."""
        with self._spent_lock:
            return self._spent_s

    def copy(self, to_arena: bool, host_indices: torch.Tensor, first: int,
             slots: Sequence[Optional[tuple[int, int]]], arena: Any) -> None:
        """Copies page `first + i` of `host_indices` (SGLang's token slots,
        `page_size` per page, page-aligned) out of (`to_arena`) or into the
        host pool, for every `slots[i]` = (offset, length) in `arena` that is
        not None. Raises on a slot of the wrong size or out of bounds (the
        caller turns that into a failed page)."""
        wanted = [(i, s) for i, s in enumerate(slots) if s is not None]
        if not wanted:
            return
        ps, bpp, n = self.page_size, self.buffers_per_page, self.buffer_bytes
        start = wanted[0][0]  # the pages from first + start on are asked for their pointers
        ptrs, _ = self._pool.get_page_buffer_meta(host_indices[(first + start) * ps:(first + wanted[-1][0] + 1) * ps])
        arena_at: list[int] = []
        host_at: list[int] = []
        for i, (off, length) in wanted:
            if length != self.page_bytes:
                raise ConfigError(f"UCMStorage: a slot of {length} bytes for a {self.page_bytes}-byte page")
            row = (i - start) * bpp
            for j in range(bpp):
                arena_at.append(off + j * n)
                host_at.append(ptrs[row + j] - self._base)
        t0 = time.perf_counter()
        try:
            if to_arena:
                _native.copy_spans(arena, arena_at, self._flat, host_at, n, self._threads)
            else:
                _native.copy_spans(self._flat, host_at, arena, arena_at, n, self._threads)
        finally:
            spent = time.perf_counter() - t0
            with self._spent_lock:
                self._spent_s += spent
