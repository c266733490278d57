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
from ucm.codecs.layout import ELEM_BYTES, KvLayout, paged_head_major_layout
from ucm.connectors.kv_pages import SKIP, PageLayout


def cpu_kv_layout(tensor: torch.Tensor, page_dim: int, page: PageLayout, num_layers: int,
                  pages_per_block: int) -> Optional[KvLayout]:
    """The KV layout of a block for vLLM's CPU backend (`LBHNC`: a layer
    tensor `[num_blocks, kv_heads, page_tokens, 2 * head_size]`, read by the
    backend as `[.., kv_heads, 2 * page_tokens, head_size]`: per head all K
    of the page, then all V), or None for a tensor of another shape or a
    dtype the codecs do not describe (its blocks are then stored without a
    lossy codec)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dim() != 4 or page_dim != 0 or len(page.chunks) != 1 or tensor.shape[3] % 2 or dtype not in ELEM_BYTES:
        return None
    _, heads, page_tokens, two_d = (int(n) for n in tensor.shape)
    if page.page_bytes != heads * page_tokens * two_d * tensor.element_size():
        return None
    return paged_head_major_layout(dtype, num_layers, heads, pages_per_block, page_tokens, two_d // 2)


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
