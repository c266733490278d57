"""The vocabulary of placement decisions: what a Placement returns and
what the cache, the plan executor, the staging and the trace replay act on.

A `Plan` is a list of `Step`s executed in order (`Op`: write, move, copy,
drop, between tier indexes); `Decision` and `RunDecision` are the outcomes
of placing one block or a run of them; `TierSpec` names a tier and its
capacity, `TierCounters` counts what happened in one. `check_tiers` and
`check_next_uses` are the argument checks both placement engines
(ucm/placement/engine.py, ucm/placement/native.py) make. Plain values; nothing
here decides or moves anything.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.heat import Key


class Op(enum.Enum):
    WRITE = "write"  # new bytes from the caller into `dst`
    MOVE = "move"  # bytes from `src` to `dst`, then drop from `src` (demotion)
    COPY = "copy"  # bytes from `src` to `dst`, `src` keeps its copy (promotion)
    DROP = "drop"  # delete from `src`


class Step(NamedTuple):
    op: Op
    key: Key
    src: Optional[int] = None
    dst: Optional[int] = None


Plan = list[Step]


@dataclass(slots=True)
class Decision:
    """Outcome of insert/promote: whether the block was placed, and the steps
    to execute either way (evictions made before a refusal stay valid)."""

    placed: bool
    plan: Plan


@dataclass(slots=True)
class RunDecision:
    """Outcome of `insert_run`: per key, whether this call placed it; `stop`,
    the index of the first key neither placed nor already cached (the keys
    after it were not tried; `len(keys)` if none); one plan for the run
    (evictions made before a refusal stay valid)."""

    placed: list[bool]
    plan: Plan
    stop: int


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    capacity_bytes: int


@dataclass(slots=True)
class TierCounters:
    inserts: int = 0
    hits: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    bytes_written: int = 0


def check_tiers(tiers: Sequence[TierSpec], landing: int) -> None:
    """The tier specs of a placement, checked (both engines): at least one,
    a landing index among them, no negative capacity."""
    if not tiers:
        raise ArgumentError("placement needs at least one tier")
    if not 0 <= landing < len(tiers):
        raise ArgumentError(f"landing tier index {landing} outside 0..{len(tiers) - 1}")
    for spec in tiers:
        if spec.capacity_bytes < 0:
            raise ArgumentError(f"tier {spec.name!r}: capacity_bytes must be >= 0")


def check_next_uses(keys: Sequence[Key], next_uses: Optional[Sequence[float]]) -> None:
    """The oracle's next uses of a request (both engines): None, or one
    number per key and no NaN (NaN has no place in an order)."""
    if next_uses is None:
        return
    if len(next_uses) != len(keys):
        raise ArgumentError(f"record_request: {len(keys)} keys but {len(next_uses)} next uses")
    if any(nu != nu for nu in next_uses):
        raise ArgumentError("record_request: a next use is NaN")
