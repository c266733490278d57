"""The geometry of a selection: which units are always kept, which are
candidates, how many candidates a budget takes, and the token ranges that
result (the rules are in ucm/accelerators/sparse/base.py). Pure numpy on
unit indices; no scoring here."""
from __future__ import annotations

from typing import Optional

import numpy as np


def candidate_units(n_tokens: int, unit_tokens: int, scored_units: int, sink_tokens: int,
                    local_tokens: int) -> np.ndarray:
    """Indices of the scored units that touch neither the sink `[0,
    sink_tokens)` nor the local window `[n_tokens - local_tokens,
    n_tokens)`, in order."""
    u = np.arange(scored_units, dtype=np.int64)
    first, end = u * unit_tokens, (u + 1) * unit_tokens
    free = (first >= sink_tokens) & (end <= n_tokens - local_tokens)
    return u[free]


def take_count(rank: np.ndarray, mass: np.ndarray, unit_tokens: int, cap_tokens: Optional[int],
               top_p: Optional[float]) -> tuple[np.ndarray, int]:
    """(order of the candidates best first, how many of them the budget
    takes): a token cap takes `cap_tokens // unit_tokens` whole units; top-p
    the fewest whose mass reaches `top_p` of the total (all at 1)."""
    n = rank.shape[0]
    order = np.argsort(-rank, kind="stable")
    if cap_tokens is not None:
        return order, min(n, cap_tokens // unit_tokens)
    if n == 0 or top_p is None or top_p >= 1.0:
        return order, n
    cum = np.cumsum(mass[order], dtype=np.float64)
    total = cum[-1]
    if not total > 0:
        return order, 0
    return order, min(n, int(np.searchsorted(cum, top_p * total, side="left")) + 1)


def unit_ranges(units: np.ndarray, unit_tokens: int, n_tokens: int) -> list[tuple[int, int]]:
    """The token ranges of `units` (any order), merged and clipped to `n_tokens`."""
    out: list[tuple[int, int]] = []
    for u in np.unique(units).tolist():
        a, b = u * unit_tokens, min((u + 1) * unit_tokens, n_tokens)
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return out


def merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and out[-1][1] >= a:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)
