"""How much a prompt's question reads each token of a blended prompt, for
transformers: `question_attention` runs the question's tokens through a
model's decoder layers over the blended K/V (ucm/connectors/transformers/
blend.py, before any reused token is recomputed; the tokens no entry
covers run in the same pass) and sums the attention they pay each
position. The blend's `question` selection recomputes the tokens it
ranks highest.

The weights come from an attention function registered with transformers'
AttentionInterface (`attention_mass`): with `ucm_mass` (a callable) a
layer's attention is computed with explicit weights, as transformers'
eager attention does, and handed to it; without, it is plain `sdpa`, so
another caller of the same model meanwhile is served as before. The
model's configured attention is set back when the probe ends.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

ATTENTION_MASS = "ucm_attention_mass"


def question_attention(model: Any, layers: Sequence[Any], embed: Any, rotary: Any, ids: torch.Tensor,
                       keys: list[torch.Tensor], values: list[torch.Tensor], counted: range,
                       write: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per position [0, n) of the blended K/V (`keys`/`values`, per layer
    `[1, kv_heads, n, head_dim]`), the attention the prompt's tokens after
    n (`ids[n:]` of the prompt's token ids `ids`: the question) pay it,
    summed over heads, those tokens and the layers in `counted` (each of
    `layers` is called as transformers' Llama family calls a decoder
    layer). The question's own K/V are kept apart. The positions `write`
    (< n, ascending) run in the same pass, their K/V written into the
    blended K/V as a recompute writes them (their attention by `sdpa`, no
    weights kept). A ModelError where a counted layer did not pass its
    attention to transformers' attention interface."""
    from ucm.errors import ModelError

    n = int(keys[0].shape[2])
    device = keys[0].device
    write = torch.zeros(0, dtype=torch.long) if write is None else write.cpu()
    pos = torch.cat([write, torch.arange(n, len(ids))]).to(device)
    tail = len(ids) - n
    mass = torch.zeros(n, dtype=torch.float32, device=device)
    seen: set[int] = set()

    def add(layer_idx: int, weights: torch.Tensor) -> None:
        seen.add(layer_idx)
        mass.add_(weights[..., :n].sum(dim=(0, 1, 2)))

    h = embed(ids[pos.cpu()][None].to(device))
    emb = rotary(h, pos[None])
    mask = torch.zeros((len(pos), n + tail), dtype=h.dtype, device=device)
    mask.masked_fill_(torch.arange(n + tail, device=device)[None, :] > pos[:, None], torch.finfo(h.dtype).min)
    kv = _TailKV(keys, values, write.to(device))
    base = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(attention_mass())
    try:
        for i, layer in enumerate(layers):  # explicit weights only where they count; sdpa before
            out = layer(h, attention_mask=mask[None, None], position_ids=pos[None], past_key_values=kv,
                        position_embeddings=emb, use_cache=True, ucm_mass=add if i in counted else None,
                        ucm_plain_rows=len(write))
            h = out[0] if isinstance(out, tuple) else out
    finally:
        model.set_attn_implementation(base)
    if len(seen) != len(counted):
        raise ModelError(f"blend: layers {sorted(set(counted) - seen)} did not pass their attention to "
                         f"transformers' attention interface")
    return mass.cpu()


class _TailKV:
    """The cache the probe calls a decoder layer with: `update` writes the
    fresh K/V of the `write` positions (the first rows) into the layer's
    blended K/V and answers it followed by the question's fresh K/V (the
    other rows), which it keeps nowhere."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], write: torch.Tensor) -> None:
        self.keys, self.values, self.write = keys, values, write

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        w = len(self.write)
        if w:
            self.keys[layer_idx][:, :, self.write] = k[:, :, :w]
            self.values[layer_idx][:, :, self.write] = v[:, :, :w]
        return (torch.cat([self.keys[layer_idx], k[:, :, w:]], dim=2),
                torch.cat([self.values[layer_idx], v[:, :, w:]], dim=2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[2])


def attention_mass() -> str:
    """The name of an attention function (registered with transformers'
    AttentionInterface on first use): with `ucm_mass` (a callable), the
    layer's attention of the queries after the first `ucm_plain_rows`
    computed with explicit weights, which `ucm_mass(layer_idx, weights)`
    receives as `[batch, heads, queries, keys]` in float32, and the first
    `ucm_plain_rows` by `sdpa`; without `ucm_mass`, transformers' `sdpa`."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_MASS not in ALL_ATTENTION_FUNCTIONS:
        def explicit(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], *args: Any, scaling: Optional[float] = None,
                     ucm_mass: Optional[Callable[[int, torch.Tensor], None]] = None, ucm_plain_rows: int = 0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
            sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            if ucm_mass is None:
                return sdpa(module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
            w = ucm_plain_rows
            plain = None
            if w:
                plain = sdpa(module, query[:, :, :w], key, value,
                             None if attention_mask is None else attention_mask[:, :, :w], *args,
                             scaling=scaling, **kwargs)[0]
                query = query[:, :, w:]
                attention_mask = None if attention_mask is None else attention_mask[:, :, w:]
            b, heads, q, d = query.shape
            kv_heads, n = key.shape[1], key.shape[2]
            # query head h reads KV head h // groups (GQA): grouped, not repeated
            grouped = query.reshape(b, kv_heads, heads // kv_heads * q, d)
            scale = scaling if scaling is not None else d ** -0.5
            scores = (torch.matmul(grouped, key.transpose(2, 3)) * scale).view(b, heads, q, n)
            if attention_mask is not None:
                scores = scores + attention_mask[:, :, :, :n]
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
            ucm_mass(module.layer_idx, weights)
            out = torch.matmul(weights.to(query.dtype).view(b, kv_heads, -1, n), value).view(b, heads, q, d)
            out = out.transpose(1, 2)  # [batch, queries, heads, head_dim], as sdpa answers
            return (out if plain is None else torch.cat([plain, out], dim=1)).contiguous(), None

        AttentionInterface.register(ATTENTION_MASS, explicit)
    return ATTENTION_MASS
