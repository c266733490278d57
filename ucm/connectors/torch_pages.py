"""TorchPageCopier: whole-page copies between device KV tensors and arena
slots with torch ops (the path for CUDA tensors).

A block's payload in its slot is, for each layer, its pages in order, each
page its chunks (`kv_pages.PageLayout`) back to back. A load copies every
slot host-to-device into a staging buffer (one copy per slot), then scatters
pages chunk by chunk into the layer tensors (index_copy_ on a strided view
of the layer's storage); a save gathers pages into staging on the device,
then copies each slot device-to-host.

For CUDA tensors the client's arena (an mmap) is registered as pinned host
memory once per arena object (cudaHostRegister; a service restart maps a
new arena, registered when first seen; the old one is unregistered once no
copy uses it, and all are unregistered by `close`); copies run on a stream
of ucm's own per thread, non-blocking, after an optional event (a save
waits for the forward that wrote its pages), and `copy` synchronizes that
stream before it returns: the slot is committed or released right after.

On CPU tensors the same code runs synchronously (no torch.cuda call is
made); the unit tests exercise it that way. The CUDA specifics (pinning,
streams, events) are tested by tests/e2e/test_device_paths.py where a CUDA
device is present (run on an H200; `ucm bench pages` measures the copies).
A call costs a fixed 0.7-1.3 ms there (kernel launches per layer and
chunk) besides its bytes: callers give it several blocks at once.

Threads: `copy` may be called from several threads at once (the worker's
pool and the main thread); `record_ready` from the thread that runs the
engine's forward.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence

import torch

from ucm.connectors.kv_pages import SKIP, PageLayout, find_page_dim, page_layout
from ucm.errors import ConfigError

log = logging.getLogger(__name__)

STAGING_BYTES = 64 << 20  # staging per batch of slots (at least one block)


def page_views(named: Sequence[tuple[str, torch.Tensor]], num_blocks: int,
               block_strides: Optional[dict[str, int]] = None
               ) -> tuple[list[PageLayout], list[int], list[torch.Tensor]]:
    """Per layer tensor (in layer order): where its pages lie
    (`kv_pages.page_layout` over the dimension of `num_blocks` pages; the
    engine's byte stride between blocks, `block_strides[name]`, tells apart
    dimensions of that size), that dimension, and its whole storage as a
    flat uint8 tensor (one tensor per storage that several layers share):
    what a page copier is built over. Refuses (ConfigError) unequal page
    sizes and pages past their storage."""
    block_strides = block_strides or {}
    layouts, dims = [], []
    for name, t in named:
        itemsize = t.element_size()
        dim = find_page_dim(name, t.shape, num_blocks, [s * itemsize for s in t.stride()], block_strides.get(name))
        layouts.append(page_layout(name, t.shape, t.stride(), itemsize, t.storage_offset(), dim))
        dims.append(dim)
    sizes = {lay.page_bytes for lay in layouts}
    if len(sizes) != 1:
        raise ConfigError(f"UCMConnector needs equal page sizes in every layer, got {sorted(sizes)} bytes")
    storages: list[torch.Tensor] = []
    seen: dict[int, torch.Tensor] = {}
    for (name, t), lay in zip(named, layouts):
        st = t.untyped_storage()
        flat = seen.get(st.data_ptr())
        if flat is None:
            flat = seen[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
        if lay.storage_extent() > flat.numel():
            raise ConfigError(f"KV tensor {name}: pages reach byte {lay.storage_extent()} of a "
                              f"{flat.numel()}-byte storage")
        storages.append(flat)
    return layouts, dims, storages


class _PinnedArena:
    """One arena mmap seen as a uint8 tensor (and, on CUDA, registered)."""

    def __init__(self, arena: Any, cuda: bool) -> None:
        self.view = memoryview(arena)  # holds an export: the mmap cannot be unmapped under us
        self.host = (torch.frombuffer(self.view, dtype=torch.uint8) if len(self.view)
                     else torch.empty(0, dtype=torch.uint8))
        self.users = 0
        self.registered = False
        if cuda and self.host.numel():
            err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.host.numel(), 0)
            self.registered = int(getattr(err, "value", err)) == 0
            if not self.registered:
                log.warning("ucm: cudaHostRegister of the %d-byte arena failed (%s); copies use pageable memory",
                            self.host.numel(), err)

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self.registered = False
        self.host = None
        self.view.release()


class TorchPageCopier:
    """Copies whole pages between layer tensors on one device and arena slots
    (a `kv_pages.PageCopier`); see the module docstring."""

    def __init__(self, storages: Sequence[torch.Tensor], layouts: Sequence[PageLayout], pages_per_block: int,
                 staging_bytes: int = STAGING_BYTES) -> None:
        """`storages[l]`: layer l's whole storage as a flat uint8 tensor;
        `layouts[l]`: where its pages lie in it (equal page_bytes)."""
        self.device = storages[0].device
        self.cuda = self.device.type == "cuda"
        self.layouts = list(layouts)
        self.ppb = pages_per_block
        self.page_bytes = layouts[0].page_bytes
        self.block_bytes = len(layouts) * pages_per_block * self.page_bytes
        self.batch_blocks = max(1, staging_bytes // self.block_bytes)
        # Per layer and chunk: a [num_pages, chunk_len] strided view of the storage.
        self.views = [[torch.as_strided(st, (lay.num_pages, n), (lay.page_stride, 1), lay.base + off)
                       for off, n in lay.chunks] for st, lay in zip(storages, layouts)]
        self.payload_offsets = [lay.payload_offsets for lay in layouts]
        self._lock = threading.Lock()
        self._arenas: dict[int, _PinnedArena] = {}  # id(arena object) -> its host tensor
        self._current: Optional[int] = None
        self._local = threading.local()

    def arenas_registered(self) -> bool:
        """Whether every arena this copier has seen is registered (pinned)
        with CUDA; True when it has seen none."""
        with self._lock:
            return all(a.registered for a in self._arenas.values())

    # ---- ordering (CUDA only) ---------------------------------------------------
    def record_ready(self) -> Optional[Any]:
        """An event on the caller's current stream (after the work queued so
        far, e.g. the forward), for a later `copy` to wait on; None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _stream(self) -> Any:
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = torch.cuda.Stream(self.device)
        return s

    # ---- the arena ----------------------------------------------------------------
    def _acquire(self, arena: Any) -> torch.Tensor:
        with self._lock:
            key = id(arena)
            pinned = self._arenas.get(key)
            if pinned is None:
                pinned = self._arenas[key] = _PinnedArena(arena, self.cuda)
            if self._current != key:
                old, self._current = self._current, key
                if old is not None and self._arenas[old].users == 0:
                    self._arenas.pop(old).close()
            pinned.users += 1
            return pinned.host

    def _release(self, arena: Any) -> None:
        with self._lock:
            key = id(arena)
            pinned = self._arenas[key]
            pinned.users -= 1
            if pinned.users == 0 and key != self._current:
                self._arenas.pop(key).close()

    def close(self) -> None:
        """Unregisters every arena (call once no copy runs)."""
        with self._lock:
            for pinned in self._arenas.values():
                pinned.close()
            self._arenas.clear()
            self._current = None

    # ---- copies --------------------------------------------------------------------
    def copy(self, to_arena: bool, blocks: Sequence[tuple[int, Sequence[int]]], arena: Any,
             ready: Optional[Any] = None, threads: int = 1, layers: Optional[Sequence[int]] = None) -> None:
        """Copies `blocks` — (payload offset in the arena, the block's page ids,
        SKIP for pages left alone) — out of (`to_arena`) or into the layer
        tensors (`layers`: only those; None: all). Returns once the bytes
        are in place. `threads` is unused (torch copies run on the device or
        in torch's own threads)."""
        if not blocks:
            return
        host = self._acquire(arena)
        try:
            if not self.cuda:
                self._copy(to_arena, blocks, host, layers)
                return
            with torch.cuda.device(self.device):
                stream = self._stream()
                with torch.cuda.stream(stream):
                    if ready is not None:
                        stream.wait_event(ready)
                    try:
                        self._copy(to_arena, blocks, host, layers)
                    finally:
                        stream.synchronize()  # the slot is committed / released when we return
        finally:
            self._release(arena)

    def _copy(self, to_arena: bool, blocks: Sequence[tuple[int, Sequence[int]]], host: torch.Tensor,
              layers: Optional[Sequence[int]] = None) -> None:
        for i in range(0, len(blocks), self.batch_blocks):
            self._copy_batch(to_arena, blocks[i:i + self.batch_blocks], host, layers)

    def _copy_batch(self, to_arena: bool, blocks: Sequence[tuple[int, Sequence[int]]], host: torch.Tensor,
                    layers: Optional[Sequence[int]] = None) -> None:
        dev, nb, bb = self.device, len(blocks), self.block_bytes
        bi, ji, pages = [], [], []
        for b, (_, page_ids) in enumerate(blocks):
            for j, p in enumerate(page_ids):
                if p != SKIP:
                    bi.append(b)
                    ji.append(j)
                    pages.append(p)
        if not pages:
            return
        staging = torch.empty((nb, len(self.layouts), self.ppb, self.page_bytes), dtype=torch.uint8, device=dev)
        flat = staging.view(nb, bb)
        bi_t = torch.tensor(bi, dtype=torch.long, device=dev)
        ji_t = torch.tensor(ji, dtype=torch.long, device=dev)
        pages_t = torch.tensor(pages, dtype=torch.long, device=dev)
        lb = self.ppb * self.page_bytes  # one layer's part of a block
        if not to_arena:
            for b, (off, _) in enumerate(blocks):
                if layers is None:
                    flat[b].copy_(host[off:off + bb], non_blocking=True)
                else:
                    for layer in layers:
                        flat[b, layer * lb:(layer + 1) * lb].copy_(host[off + layer * lb:off + (layer + 1) * lb],
                                                                   non_blocking=True)
        for layer, (views, pos) in enumerate(zip(self.views, self.payload_offsets)):
            if layers is not None and layer not in layers:
                continue
            if to_arena:
                rows = torch.empty((len(pages), self.page_bytes), dtype=torch.uint8, device=dev)
                for view, at in zip(views, pos):
                    rows[:, at:at + view.shape[1]] = view.index_select(0, pages_t)
                staging[bi_t, layer, ji_t] = rows
            else:
                rows = staging[bi_t, layer, ji_t]  # [pages, page_bytes]
                for view, at in zip(views, pos):
                    view.index_copy_(0, pages_t, rows[:, at:at + view.shape[1]])
        if to_arena:
            for b, (off, _) in enumerate(blocks):
                host[off:off + bb].copy_(flat[b], non_blocking=True)
