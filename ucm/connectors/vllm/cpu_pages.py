"""NativePageCopier: whole-page copies between CPU KV tensors and arena
slots with ucm's native memcpy (`_native.copy_spans`), straight between the
layer storages and the slots, no staging buffer: one native call per layer
and chunk (every page of every block of the call), GIL released.

The same `kv_pages.PageCopier` interface as `torch_pages.TorchPageCopier`
(the device path), so the worker never asks which one it holds. Thread-safe:
it holds no state beyond the layouts and the storage buffers."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ucm import _native
from ucm.connectors.kv_pages import SKIP, PageLayout


class NativePageCopier:
    """Copies whole pages between CPU layer tensors and arena slots."""

    def __init__(self, storages: Sequence[torch.Tensor], layouts: Sequence[PageLayout], pages_per_block: int) -> None:
        """`storages[l]`: layer l's whole storage as a flat uint8 CPU tensor
        (layers may share one); `layouts[l]`: where its pages lie in it
        (equal page_bytes)."""
        arrays = {id(s): s.numpy() for s in storages}  # buffers over the same memory, one per storage
        self._buffers = [arrays[id(s)] for s in storages]
        self._layouts = list(layouts)
        self._page_bytes = layouts[0].page_bytes
        self._pages_per_block = pages_per_block

    def record_ready(self) -> Optional[Any]:
        return None  # CPU copies run in program order: nothing to wait for

    def copy(self, to_arena: bool, blocks: Sequence[tuple[int, Sequence[int]]], arena: Any,
             ready: Optional[Any] = None, threads: int = 1, layers: Optional[Sequence[int]] = None) -> None:
        pb = self._page_bytes
        pages = [(a + j * pb, p) for a, ids in blocks for j, p in enumerate(ids) if p != SKIP]
        if not pages:
            return
        step = self._pages_per_block * pb  # one layer's part of a block's payload
        for layer in (range(len(self._layouts)) if layers is None else layers):
            buf, lay = self._buffers[layer], self._layouts[layer]
            for (off, n), pos in zip(lay.chunks, lay.payload_offsets):
                at = [a + layer * step + pos for a, _ in pages]
                kv = [lay.base + p * lay.page_stride + off for _, p in pages]
                if to_arena:
                    _native.copy_spans(arena, at, buf, kv, n, threads)
                else:
                    _native.copy_spans(buf, kv, arena, at, n, threads)

    def close(self) -> None:
        return  # no arena is registered; the buffers are views of the engine's own tensors
