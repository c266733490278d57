"""Attention mass, true and estimated, for grouped-query attention.

`token_mass` is the layer's real attention over the context from the
query and the real keys, averaged over query heads (sums to 1): what the
oracle selects by and what recall is measured against. `estimated_mass`
turns per-head scores of units (a Quest bound, q . mean key) into each
head's softmax over the units, summed over heads and divided by their
number. Pure numpy, float32 in, float64 sums.
"""
from __future__ import annotations

import numpy as np

from ucm.accelerators.sparse.base import LayerStep, Selection
from ucm.errors import ArgumentError


def grouped(query: np.ndarray, kv_heads: int) -> np.ndarray:
    """`[q_heads, head_dim]` as `[kv_heads, group, head_dim]`: query head h
    reads KV head `h // group` (transformers' `repeat_kv`, vLLM's GQA)."""
    q_heads, dim = query.shape
    if q_heads % kv_heads:
        raise ArgumentError(f"{q_heads} query heads do not group onto {kv_heads} KV heads")
    return query.reshape(kv_heads, q_heads // kv_heads, dim)


def _softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def token_mass(query: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """The attention of `query` `[q_heads, head_dim]` over `keys`
    `[kv_heads, n_tokens, head_dim]` per token, averaged over query heads:
    `[n_tokens]`, summing to 1."""
    if keys.ndim != 3 or keys.shape[2] != query.shape[1]:
        raise ArgumentError(f"token_mass: keys {keys.shape} do not match query {query.shape}")
    qg = grouped(query, keys.shape[0])
    logits = np.einsum("hgd,htd->hgt", qg, keys, dtype=np.float32, optimize=True) * np.float32(scale)
    probs = _softmax_rows(logits.reshape(query.shape[0], -1))
    return probs.mean(axis=0)


def estimated_mass(scores: np.ndarray, scale: float, tokens_per_unit: int = 1) -> np.ndarray:
    """Per-head scores `[q_heads, units]` (an estimate of q . k for every
    token of a unit) as each head's softmax over the units, weighted by
    their tokens, summed over heads and divided by their number: `[units]`."""
    if scores.shape[1] == 0:
        return np.zeros(0, dtype=np.float64)
    logits = scores * np.float32(scale) + np.float32(np.log(tokens_per_unit))
    return _softmax_rows(logits).mean(axis=0)


def recall(step: LayerStep, selection: Selection) -> float:
    """The share of the layer's true attention mass (`step.keys`) that the
    selected tokens hold, in [0, 1]."""
    if step.keys is None:
        raise ArgumentError("recall needs the real keys (LayerStep.keys)")
    mass = token_mass(step.query, step.keys, step.softmax_scale)
    return float(mass[selection.mask()].sum())
