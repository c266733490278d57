"""SpareLayer: a transformers `DynamicLayer` that grows in place.

A `DynamicLayer` grows by concatenation: every forward copies the whole
cached sequence of every layer into new tensors (`torch.cat`), so a prompt
whose 2,048-token prefix came from a cache pays a copy of that prefix per
layer in its first forward, and every decode step pays it again. A
SpareLayer keeps its keys and values as the first `seq` positions of
buffers `[batch, kv_heads, capacity, head_dim]` with room after them: an
update writes the new positions into the room and hands out the longer
views (`keys`, `values` are views of the buffers, as attention reads them).
When the room runs out, new buffers of about 1.5x the needed length are
allocated and the cached positions copied once (amortized).

What the cache keeps is exactly what a DynamicLayer keeps (the same values
at the same positions; attention reads them through views whose strides
differ, with the same result bit for bit: tests compare greedy outputs with
a DynamicCache's). Invariant the connector relies on: positions below the
length a view was handed out with are never written again while that view
may be read (a store thread gathers blocks from them), so `crop` leaves the
buffers for good (later updates concatenate, as a DynamicLayer does), and
so does any method that replaces `keys` with a tensor of its own (beam
search's reordering, `batch_select_indices`, `reset`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.cache_utils import DynamicLayer

# Positions of room left after a prompt's prefill for the tokens decoded next.
DECODE_ROOM = 256


class SpareLayer(DynamicLayer):
    """A DynamicLayer whose tensors are views of buffers with room after them."""

    def __init__(self, room: int = DECODE_ROOM) -> None:
        super().__init__()
        self._room = max(0, int(room))
        self._kbuf: Optional[torch.Tensor] = None
        self._vbuf: Optional[torch.Tensor] = None

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        """Makes `kbuf` / `vbuf` (`[batch, kv_heads, capacity, head_dim]`,
        their first `length` positions filled) this layer's buffers."""
        super().lazy_initialization(kbuf[:, :, :0], vbuf[:, :, :0])
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :length], vbuf[:, :, :length]

    def _in_buffers(self, key_states: torch.Tensor) -> bool:
        k, buf = self.keys, self._kbuf
        return (buf is not None and k is not None and self.values is not None and k.ndim == 4
                and k.data_ptr() == buf.data_ptr() and self.values.data_ptr() == self._vbuf.data_ptr()
                and k.stride() == buf.stride() and k.shape[:2] == buf.shape[:2]
                and key_states.shape[:2] == buf.shape[:2] and key_states.shape[3] == buf.shape[3]
                and key_states.dtype == buf.dtype and key_states.device == buf.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._kbuf is not None and not self._in_buffers(key_states):
            self._kbuf = self._vbuf = None  # keys were replaced (reorder, select, reset): grow as DynamicLayer
        if self._kbuf is None and self.keys.numel() and self.keys.ndim == 4:
            return super().update(key_states, value_states, *args, **kwargs)
        seq = self.keys.shape[-2] if self.keys.ndim == 4 else 0
        end = seq + key_states.shape[-2]
        if self._kbuf is None or end > self._kbuf.shape[2]:
            self._grow(key_states, seq, end)
        self._kbuf[:, :, seq:end].copy_(key_states)
        self._vbuf[:, :, seq:end].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]
        return self.keys, self.values

    def _grow(self, like: torch.Tensor, seq: int, end: int) -> None:
        """New buffers of room for `end` positions and more, the first `seq`
        copied (the old buffers are never written again)."""
        b, h, _, d = like.shape
        cap = end + (self._room if self._kbuf is None else max(self._room, end // 2))
        kbuf = torch.empty((b, h, cap, d), dtype=like.dtype, device=like.device)
        vbuf = torch.empty((b, h, cap, d), dtype=like.dtype, device=like.device)
        if seq:
            kbuf[:, :, :seq].copy_(self.keys)
            vbuf[:, :, :seq].copy_(self.values)
        self._kbuf, self._vbuf = kbuf, vbuf

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._kbuf = self._vbuf = None  # later positions are concatenated: the cropped views are never overwritten

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()
