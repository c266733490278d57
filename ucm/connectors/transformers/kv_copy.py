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

from typing import Sequence

import torch


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


def scatter_block(blob: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  row: int, start: int, n_tokens: int) -> None:
    """One block `blob` (`[layers, 2, kv_heads, block_tokens, head_dim]`):
    its first `n_tokens` tokens into row `row` from position `start`."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        k[row, :, start:start + n_tokens, :].copy_(blob[layer, 0, :, :n_tokens, :])
        v[row, :, start:start + n_tokens, :].copy_(blob[layer, 1, :, :n_tokens, :])
