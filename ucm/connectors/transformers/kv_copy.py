"""Copies between a transformers cache's layer tensors and block payloads.

Layer tensors are `[batch, kv_heads, seq, head_dim]` (transformers'
`DynamicLayer`); a block payload is `[layers, 2, kv_heads, block_tokens,
head_dim]` (namespace.BlockLayout, layer-major, K before V). Row `b` of a
left-padded batch has `pad` padding positions first: its real token `t` is
at sequence position `pad + t`, so its block `j` covers positions
`[pad + j * block_tokens, pad + (j + 1) * block_tokens)`.

Everything here runs in the thread that calls it and only moves bytes;
shapes and dtypes are the caller's to check (connector.py).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ucm import _native


def gather_blocks(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], row: int, start: int,
                  n_blocks: int, block_tokens: int, out: torch.Tensor) -> None:
    """Writes blocks of row `row` whose first token is at sequence position
    `start` into `out` (`[n_blocks, layers, 2, kv_heads, block_tokens,
    head_dim]`)."""
    end = start + n_blocks * block_tokens
    for layer, (k, v) in enumerate(zip(keys, values)):
        heads, dim = k.shape[1], k.shape[3]
        for j, t in enumerate((k, v)):
            seg = t[row, :, start:end, :].reshape(heads, n_blocks, block_tokens, dim)
            out[:, layer, j].copy_(seg.transpose(0, 1))


def scatter_blocks(payload: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                   row: int, start: int, n_tokens: int) -> None:
    """Copies the first `n_tokens` tokens of consecutive blocks `payload`
    (`[n, layers, 2, kv_heads, block_tokens, head_dim]`, on any device) into
    row `row` of the layer tensors from sequence position `start`."""
    n, _, _, heads, bt, dim = payload.shape
    full, rest = divmod(n_tokens, bt)
    for layer, (k, v) in enumerate(zip(keys, values)):
        for j, t in enumerate((k, v)):
            src = payload[:, layer, j]  # [n, heads, bt, dim]
            if full:
                dst = t[row, :, start:start + full * bt, :].view(heads, full, bt, dim)
                dst.copy_(src[:full].transpose(0, 1), non_blocking=True)
            if rest:
                a = start + full * bt
                t[row, :, a:a + rest, :].copy_(src[full, :, :rest, :], non_blocking=True)


def byte_view(t: torch.Tensor):
    """A writable uint8 numpy view of the contiguous CPU tensor `t` (for
    ucm._native's copies, which take buffers)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return t.view(-1).view(torch.uint8).numpy()


def spans_into_layers(arena: Any, blocks: Sequence[tuple[int, int, int]], shape: Sequence[int], itemsize: int,
                      kbytes: Sequence[Any], vbytes: Sequence[Any], row: int, capacity: int,
                      layers: Iterable[int]) -> None:
    """Copies layers `layers` of blocks held in `arena` (a buffer) into row
    `row` of layer buffers `[batch, kv_heads, capacity, head_dim]` (given as
    `byte_view`s `kbytes[l]`, `vbytes[l]`): `blocks` are (byte offset of the
    block's payload in `arena`, first sequence position, tokens), a payload
    being `shape` = `[layers, 2, kv_heads, block_tokens, head_dim]` of
    `itemsize`-byte elements. Per layer and K/V one native copy of every
    (block, head) span (`_native.copy_spans`, GIL released, bounds checked)."""
    _, _, heads, bt, dim = shape
    tok = dim * itemsize
    hs = np.arange(heads, dtype=np.int64)
    groups: dict[int, list[tuple[int, int]]] = {}
    for off, pos, n in blocks:
        if n > 0:
            groups.setdefault(n, []).append((off, pos))
    plans = []
    for n, group in groups.items():
        offs = np.array([o for o, _ in group], dtype=np.int64)[:, None]
        poss = np.array([p for _, p in group], dtype=np.int64)[:, None]
        dst = (((row * heads + hs[None, :]) * capacity + poss) * tok).ravel().tolist()
        plans.append((offs, dst, n * tok))
    for layer in layers:
        for kv, bufs in ((0, kbytes), (1, vbytes)):
            head0 = ((layer * 2 + kv) * heads + hs[None, :]) * bt * tok
            for offs, dst, length in plans:
                _native.copy_spans(bufs[layer], dst, arena, (offs + head0).ravel().tolist(), length, 1)
