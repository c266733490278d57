"""Attention over queries spread across a prompt, for transformers:
`bands` cuts ascending positions into a few bands, and `banded_sdpa`
names an attention function (registered with transformers'
AttentionInterface) that runs transformers' `sdpa` band by band, each band
of queries over the keys up to its last position. A masked product over
the whole prompt computes every query against every key; band by band it
computes about half of that. The blend's recompute
(ucm/connectors/transformers/blend.py) calls a model's layers with
`ucm_bands=bands(positions)` while the model's attention is
`banded_sdpa()`; without `ucm_bands` the function is plain `sdpa`, so
another caller of the same model meanwhile is served as before.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

BANDED_SDPA = "ucm_banded_sdpa"


def banded_sdpa() -> str:
    """The name of an attention function (registered with transformers'
    AttentionInterface on first use) that is transformers' `sdpa` band by
    band when a layer is called with `ucm_bands`, and plain `sdpa` without:
    a band of queries attends over the keys up to its last position only,
    which halves the masked product of tokens spread over the prompt."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if BANDED_SDPA not in ALL_ATTENTION_FUNCTIONS:
        def banded(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], *args: Any, ucm_bands: Optional[list] = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
            sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
            if ucm_bands is None or attention_mask is None:
                return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
            groups = getattr(module, "num_key_value_groups", 1)
            if groups > 1:  # GQA: the KV heads repeated once for every band, not by sdpa in each band
                key, value = repeat_kv(key, groups), repeat_kv(value, groups)
                module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True),
                                         layer_idx=getattr(module, "layer_idx", None), training=module.training)
            out = [sdpa(module, query[:, :, lo:hi], key[:, :, :end], value[:, :, :end],
                        attention_mask[:, :, lo:hi, :end], *args, **kwargs)[0] for lo, hi, end in ucm_bands]
            return torch.cat(out, dim=1), None  # [batch, queries, heads, head_dim], as sdpa answers

        AttentionInterface.register(BANDED_SDPA, banded)
    return BANDED_SDPA


def bands(pos: torch.Tensor, most: int = 8, least: int = 32) -> list[tuple[int, int, int]]:
    """The queries at `pos` (ascending) in up to `most` bands of at least
    `least`: (first, end, keys) with keys one past the band's last position."""
    q = len(pos)
    count = max(1, min(most, q // least))
    edges = [round(i * q / count) for i in range(count + 1)]
    return [(lo, hi, int(pos[hi - 1]) + 1) for lo, hi in zip(edges, edges[1:]) if hi > lo]
