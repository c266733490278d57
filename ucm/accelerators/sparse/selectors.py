"""The selectors, side by side behind `ucm.accelerators.sparse.base.Selector`:

- `oracle`: the true attention mass of each unit, from the query and the
  real keys: the upper bound of any selector at a budget;
- `quest`: Quest's upper bound of q . k over a unit, sum over channels of
  `max(q * min, q * max)` from the unit's per-channel key min and max;
- `mean`: q . the unit's mean key (UCM's ESA / GSA);
- `sinklocal`: no scoring; the budget widens the local window (the most
  recent candidates first, StreamingLLM);
- `random`: candidates in a seeded random order.

`make_selector(name, **options)` builds one by name. Every selector's
scores go through `select` (base.py), so sink, local, tail and the budget
rules are the same for all.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ucm.accelerators.sparse.base import LayerStep, Selector, UnitSummaries
from ucm.accelerators.sparse.mass import estimated_mass, grouped, token_mass
from ucm.errors import ArgumentError, ConfigError


def _summaries(step: LayerStep, who: str) -> UnitSummaries:
    if step.summaries is None:
        raise ArgumentError(f"selector {who!r} needs the units' key summaries (LayerStep.summaries)")
    return step.summaries


def quest_bound(query: np.ndarray, key_min: np.ndarray, key_max: np.ndarray) -> np.ndarray:
    """Quest's bound `[q_heads, units]` of q . k over every key of a unit,
    from `key_min` / `key_max` `[units, kv_heads, head_dim]` (GQA grouped):
    sum over channels of `max(q * min, q * max)` = `q+ . max + q- . min`."""
    qg = grouped(query, key_min.shape[1])
    pos, neg = np.maximum(qg, 0), np.minimum(qg, 0)
    out = np.einsum("hgd,uhd->hgu", pos, key_max, optimize=True) + np.einsum("hgd,uhd->hgu", neg, key_min,
                                                                            optimize=True)
    return out.reshape(query.shape[0], -1)


def mean_score(query: np.ndarray, key_mean: np.ndarray) -> np.ndarray:
    """q . mean key, `[q_heads, units]`."""
    qg = grouped(query, key_mean.shape[1])
    return np.einsum("hgd,uhd->hgu", qg, key_mean, optimize=True).reshape(query.shape[0], -1)


class OracleSelector(Selector):
    name = "oracle"
    needs_keys = True

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if step.keys is None:
            raise ArgumentError("selector 'oracle' needs the real keys (LayerStep.keys)")
        mass = token_mass(step.query, step.keys, step.softmax_scale)
        u = step.unit_tokens
        per_unit = mass[:step.scored_units * u].reshape(-1, u).sum(axis=1)[candidates]
        return per_unit, per_unit


class QuestSelector(Selector):
    name = "quest"

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self.name)
        bound = quest_bound(step.query, s.min[candidates], s.max[candidates])
        mass = estimated_mass(bound, step.softmax_scale)
        return mass, mass


class MeanSelector(Selector):
    name = "mean"

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self.name)
        mass = estimated_mass(mean_score(step.query, s.mean[candidates]), step.softmax_scale)
        return mass, mass


class SinkLocalSelector(Selector):
    name = "sinklocal"

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return candidates.astype(np.float64), np.ones(candidates.shape[0])


class RandomSelector(Selector):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._rng.random(candidates.shape[0]), np.ones(candidates.shape[0])


SELECTORS: dict[str, type[Selector]] = {c.name: c for c in (OracleSelector, QuestSelector, MeanSelector,
                                                           SinkLocalSelector, RandomSelector)}


def make_selector(name: str, **options: Any) -> Selector:
    """The selector called `name`; ConfigError naming the known ones."""
    cls = SELECTORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown sparse selector {name!r}; known: {sorted(SELECTORS)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"sparse selector {name!r}: bad options {sorted(options)}: {exc}") from None
