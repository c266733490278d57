"""The selector interface of sparse attention and its value types.

At one decode step, for one layer, a `Selector` picks which tokens of the
context the layer attends to: the sink (the first `sink_tokens`), the
local window (the last `local_tokens`) and the tail (tokens after the last
scored unit: a block not yet full has no summary) always, and on top of
them the units (pages of a block, or whole blocks) it scores highest,
within a `Budget`. One selection per layer is shared by all its query
heads: the query heads are grouped onto their KV head as GQA does (query
head h reads KV head `h // (q_heads // kv_heads)`), each head's scores are
turned into its estimated attention mass over the candidate units, and the
masses are summed over heads.

Budgets count the tokens selected beyond sink, local and tail:
- `Budget.tokens(n)`: at most n tokens, whole units: `min(n // unit,
  candidates) * unit` exactly;
- `Budget.ratio(r)`: as `tokens(floor(r * context tokens))`;
- `Budget.top_p(p)`: the fewest best-ranked candidates whose estimated
  mass reaches p of all the candidates' estimated mass (every candidate at
  p = 1).

Selectors are pure functions of their inputs (`random` of its seed and the
calls before); they run in the caller's thread and keep no lock.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ucm.accelerators.sparse.units import candidate_units, merge_ranges, take_count, unit_ranges
from ucm.errors import ArgumentError

BUDGET_KINDS = ("tokens", "ratio", "top_p")


@dataclass(frozen=True, slots=True)
class Budget:
    kind: str  # one of BUDGET_KINDS
    value: float

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_KINDS:
            raise ArgumentError(f"Budget.kind {self.kind!r} not one of {list(BUDGET_KINDS)}")
        v = self.value
        ok = {"tokens": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "ratio": isinstance(v, (int, float)) and 0.0 <= v <= 1.0,
              "top_p": isinstance(v, (int, float)) and 0.0 < v <= 1.0}[self.kind]
        if not ok:
            allowed = {"tokens": "an int >= 0", "ratio": "a number in [0, 1]", "top_p": "a number in (0, 1]"}
            raise ArgumentError(f"Budget {self.kind}: value must be {allowed[self.kind]}, got {v!r}")

    @classmethod
    def tokens(cls, n: int) -> "Budget":
        return cls("tokens", n)

    @classmethod
    def ratio(cls, r: float) -> "Budget":
        return cls("ratio", r)

    @classmethod
    def top_p(cls, p: float) -> "Budget":
        return cls("top_p", p)

    def token_cap(self, context_tokens: int) -> Optional[int]:
        """The tokens a fixed budget allows over `context_tokens`; None for top-p."""
        if self.kind == "tokens":
            return int(self.value)
        if self.kind == "ratio":
            return math.floor(self.value * context_tokens)
        return None


@dataclass(frozen=True, slots=True)
class SelectionConfig:
    budget: Budget
    sink_tokens: int = 128
    local_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            raise ArgumentError(f"SelectionConfig.budget must be a Budget, got {type(self.budget).__name__}")
        for name in ("sink_tokens", "local_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ArgumentError(f"SelectionConfig.{name} must be an int >= 0, got {v!r}")


@dataclass(frozen=True, slots=True, eq=False)
class UnitSummaries:
    """One layer's key summaries of the first `units` units of the context
    (unit u covers tokens `[u * unit_tokens, (u + 1) * unit_tokens)`):
    `min`, `max` and `mean`, each `[units, kv_heads, head_dim]` float32, or
    None where the summaries do not keep that part (`Selector.needs_*`
    says who reads which)."""

    unit_tokens: int
    units: int
    min: Optional[np.ndarray]
    max: Optional[np.ndarray]
    mean: Optional[np.ndarray]
    # the units' tokens' projected keys `[kv_heads, units x unit_tokens, rank]` float32 and the layer's basis
    # `[kv_heads, head_dim, rank]` (lowrank.py), when the summaries were made with one
    proj: Optional[np.ndarray] = None
    basis: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        for name in ("min", "max", "mean"):
            a = getattr(self, name)
            if a is not None and a.shape[0] != self.units:
                raise ArgumentError(f"UnitSummaries.{name} has {a.shape[0]} units, not {self.units}")
        if self.proj is not None and self.proj.shape[1] != self.units * self.unit_tokens:
            raise ArgumentError(f"UnitSummaries.proj covers {self.proj.shape[1]} tokens, not "
                                f"{self.units} x {self.unit_tokens}")


@dataclass(frozen=True, slots=True, eq=False)
class LayerStep:
    """What one layer knows at one decode step. `query` is `[q_heads,
    head_dim]` float32 (after RoPE, as the layer attends with it); `keys`,
    the real keys `[kv_heads, n_tokens, head_dim]`, only for `oracle`;
    `summaries` for the scoring selectors. Scored units are the context's
    full units (those `summaries` cover, when given); `scale` defaults to
    `1 / sqrt(head_dim)`."""

    query: np.ndarray
    n_tokens: int
    unit_tokens: int
    kv_heads: int
    summaries: Optional[UnitSummaries] = None
    keys: Optional[np.ndarray] = None
    scale: Optional[float] = None

    def __post_init__(self) -> None:
        q = self.query
        if not isinstance(q, np.ndarray) or q.ndim != 2:
            raise ArgumentError(f"LayerStep.query must be a [q_heads, head_dim] array, got "
                                f"{getattr(q, 'shape', type(q).__name__)}")
        if self.kv_heads <= 0 or q.shape[0] % self.kv_heads:
            raise ArgumentError(f"LayerStep: {q.shape[0]} query heads do not group onto {self.kv_heads} KV heads")
        if self.unit_tokens <= 0 or self.n_tokens < 0:
            raise ArgumentError(f"LayerStep: unit_tokens {self.unit_tokens} must be > 0 and n_tokens "
                                f"{self.n_tokens} >= 0")
        s = self.summaries
        if s is not None and (s.unit_tokens != self.unit_tokens or s.units * s.unit_tokens > self.n_tokens):
            raise ArgumentError(f"LayerStep: summaries of {s.units} units of {s.unit_tokens} tokens do not fit "
                                f"{self.n_tokens} tokens in units of {self.unit_tokens}")

    @property
    def head_dim(self) -> int:
        return self.query.shape[1]

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def scored_units(self) -> int:
        if self.summaries is not None:
            return self.summaries.units
        return self.n_tokens // self.unit_tokens


@dataclass(frozen=True, slots=True, eq=False)
class Selection:
    """The tokens one layer attends to at one step: sorted, disjoint,
    half-open ranges over `[0, n_tokens)`."""

    n_tokens: int
    ranges: tuple[tuple[int, int], ...]
    kept_tokens: int  # sink, local and tail
    extra_tokens: int  # selected on top of them, within the budget
    units: tuple[int, ...] = field(default=())  # the selected candidate units, best first

    @property
    def tokens(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def mask(self) -> np.ndarray:
        out = np.zeros(self.n_tokens, dtype=bool)
        for a, b in self.ranges:
            out[a:b] = True
        return out


class Selector(abc.ABC):
    """Scores candidate units; `select` does the rest (which units are
    always kept, the budget, the ranges: ucm/accelerators/sparse/units.py)."""

    name: str = ""
    needs_keys: bool = False  # scores from the real keys (the oracle), not summaries
    needs_bounds: bool = False  # reads `UnitSummaries.min` and `.max` (callers may skip keeping them otherwise)
    needs_mean: bool = False  # reads `UnitSummaries.mean` (callers may skip keeping it otherwise)
    needs_proj: bool = False  # reads `UnitSummaries.proj` and `.basis` (summaries made with a KeyBasis)

    @abc.abstractmethod
    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rank, mass) per candidate unit (indices `candidates`): the best
        have the highest rank; mass is the estimated (or true) attention mass
        top-p adds up, >= 0."""

    def select(self, step: LayerStep, config: SelectionConfig) -> Selection:
        """The tokens the layer attends to at this step (module docstring)."""
        u, n = step.unit_tokens, step.n_tokens
        cands = candidate_units(n, u, step.scored_units, config.sink_tokens, config.local_tokens)
        rank, mass = self.score(step, cands)
        order, k = take_count(np.asarray(rank), np.asarray(mass), u, config.budget.token_cap(n),
                              config.budget.value if config.budget.kind == "top_p" else None)
        chosen = cands[order[:k]]
        left_out = np.setdiff1d(cands, chosen)
        ranges = merge_ranges(_complement(unit_ranges(left_out, u, n), n))
        return Selection(n, ranges, kept_tokens=n - cands.size * u, extra_tokens=k * u,
                         units=tuple(chosen.tolist()))


def _complement(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for a, b in ranges:
        out.append((at, a))
        at = b
    out.append((at, n))
    return out
