"""The selectors, side by side behind `ucm.accelerators.sparse.base.Selector`:

- `oracle`: the true attention mass of each unit, from the query and the
  real keys: the upper bound of any selector at a budget;
- `quest`: Quest's upper bound of q . k over a unit, sum over channels of
  `max(q * min, q * max)` from the unit's per-channel key min and max;
- `mean`: q . the unit's mean key (UCM's ESA / GSA);
- `moment`: an estimate of the unit's attention mass itself, from the
  same three summaries: each channel's keys taken as normal with the
  unit's mean and a deviation of its range over `expected_range` of the
  unit's tokens, so `log sum exp(s q . k)` over the unit is about
  `log n + s q . mean + spread * s^2 / 2 sum_d q_d^2 sigma_d^2` (a page
  whose keys spread along the query's channels holds more mass than its
  mean says, less than Quest's bound says). `spread` is 1 for independent
  normal channels; real keys are heavier-tailed and correlated, and the
  default 1.5 was chosen on a model's real queries (docs/lab/benchmarks.md).
  Not a bound;
- `blend`: half quest's bound, half moment's estimate, per query head,
  and the heads combined by their mean score (as the product of their
  estimated masses ranks) rather than the mean of their masses. Per layer,
  quest's bound does better where attention sits on single keys and
  moment where it spreads over a page (early and late layers);
  the blend holds more of the attention than either at long contexts
  (docs/lab/benchmarks.md, "the `blend` selector"). Reads the same three
  summaries; `weight` (0.5) is quest's share;
- `lowrank`: the oracle's rule over approximate keys: every token's key
  projected on a per-layer, per-head basis of `rank` leading directions
  (Loki; lowrank.py), kept in the summaries, gives each token's logit and
  so each unit's attention mass. Needs summaries made with a `KeyBasis`
  (`UnitSummaries.proj`). Offline it holds more of the attention than
  the page summaries' selectors; at a low rank it misses the few tokens a
  head needs whose match lies outside its directions, so decoding wants a
  higher one (docs/lab/benchmarks.md);
- `hybrid`: lowrank's picks and quest's side by side: of every budget,
  `quest_share` (0.25) goes to quest's best units and the rest to
  lowrank's, a unit both pick counted once (`interleaved_rank`). lowrank
  holds the mass that continuations need but can lose the single needle
  a retrieval head looks for (a match outside its directions), which
  quest's bound over all channels keeps (docs/lab/benchmarks.md, "lowrank
  and quest together"). Reads the projections and the bounds; top-p adds
  up lowrank's mass in the merged order. The connectors' default;
- `sinklocal`: no scoring; the budget widens the local window (the most
  recent candidates first, StreamingLLM);
- `random`: candidates in a seeded random order.

`make_selector(name, **options)` builds one by name. Every selector's
scores go through `select` (base.py), so sink, local, tail and the budget
rules are the same for all.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from ucm.accelerators.sparse.base import LayerStep, Selector, UnitSummaries
from ucm.accelerators.sparse.lowrank import lowrank_mass
from ucm.accelerators.sparse.mass import estimated_mass, grouped, token_mass
from ucm.errors import ArgumentError, ConfigError


def _summaries(step: LayerStep, selector: Selector) -> UnitSummaries:
    """The step's summaries, holding every part `selector` reads."""
    s = step.summaries
    who = selector.name
    if s is None:
        raise ArgumentError(f"selector {who!r} needs the units' key summaries (LayerStep.summaries)")
    if selector.needs_bounds and (s.min is None or s.max is None):
        raise ArgumentError(f"selector {who!r} needs summaries that keep the key bounds (UnitSummaries.min, .max)")
    if selector.needs_mean and s.mean is None:
        raise ArgumentError(f"selector {who!r} needs summaries that keep the mean key (UnitSummaries.mean)")
    if selector.needs_proj and (s.proj is None or s.basis is None):
        raise ArgumentError(f"selector {who!r} needs summaries made with a KeyBasis (UnitSummaries.proj)")
    return s


def _option(selector: str, option: str, value: object, high: float) -> float:
    """A selector's numeric option as a float in `[0, high]`; ConfigError
    naming the selector and the option otherwise (a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
        raise ConfigError(f"sparse selector {selector!r}: {option} must be a number in [0, {high:g}], got {value!r}")
    return float(value)


def _unit_sums(mass: np.ndarray, step: LayerStep, candidates: np.ndarray) -> np.ndarray:
    """Per-token `mass` summed over each scored unit, for `candidates`."""
    u = step.unit_tokens
    return mass[:step.scored_units * u].reshape(-1, u).sum(axis=1)[candidates]


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


@lru_cache(maxsize=64)
def expected_range(n: int) -> float:
    """The expected range (max - min) of `n` independent standard normal
    samples, by numerical integration of `1 - F(x)^n - (1 - F(x))^n`: 1.128
    for 2, 3.532 for 16, 5.189 for 128; 0 below 2."""
    if n < 2:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    cdf = 0.5 * (1.0 + np.frompyfunc(math.erf, 1, 1)(x / math.sqrt(2.0)).astype(np.float64))
    y = 1.0 - cdf ** n - (1.0 - cdf) ** n
    return float((y[:-1] + y[1:]).sum() * (x[1] - x[0]) / 2.0)  # the trapezoid rule (numpy 1.x has no trapezoid)


def moment_score(query: np.ndarray, key_mean: np.ndarray, key_min: np.ndarray, key_max: np.ndarray,
                 unit_tokens: int, scale: float, spread: float = 1.0) -> np.ndarray:
    """`[q_heads, units]`: the q . k whose exp, times the unit's tokens,
    estimates the unit's `sum exp(scale * q . k)` (module docstring):
    `q . mean + spread * scale / 2 * sum_d q_d^2 sigma_d^2`, `sigma = (max -
    min) / expected_range(unit_tokens)`."""
    qg = grouped(query, key_mean.shape[1])
    d2 = expected_range(unit_tokens)
    var = np.square((key_max - key_min) / np.float32(d2)) if d2 > 0 else np.zeros_like(key_mean)
    mu = np.einsum("hgd,uhd->hgu", qg, key_mean, optimize=True)
    var_q = np.einsum("hgd,uhd->hgu", qg * qg, var, optimize=True)
    return (mu + np.float32(0.5 * scale * spread) * var_q).reshape(query.shape[0], -1)


class OracleSelector(Selector):
    name = "oracle"
    needs_keys = True

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if step.keys is None:
            raise ArgumentError("selector 'oracle' needs the real keys (LayerStep.keys)")
        per_unit = _unit_sums(token_mass(step.query, step.keys, step.softmax_scale), step, candidates)
        return per_unit, per_unit


class QuestSelector(Selector):
    name = "quest"
    needs_bounds = True

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self)
        bound = quest_bound(step.query, s.min[candidates], s.max[candidates])
        mass = estimated_mass(bound, step.softmax_scale)
        return mass, mass


class MeanSelector(Selector):
    name = "mean"
    needs_mean = True

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self)
        mass = estimated_mass(mean_score(step.query, s.mean[candidates]), step.softmax_scale)
        return mass, mass


class MomentSelector(Selector):
    name = "moment"
    needs_bounds = True
    needs_mean = True

    def __init__(self, spread: float = 1.5) -> None:
        self.spread = _option(self.name, "spread", spread, 100)

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self)
        est = moment_score(step.query, s.mean[candidates], s.min[candidates], s.max[candidates], s.unit_tokens,
                           step.softmax_scale, self.spread)
        mass = estimated_mass(est, step.softmax_scale)
        return mass, mass


def blend_score(query: np.ndarray, key_mean: np.ndarray, key_min: np.ndarray, key_max: np.ndarray,
                unit_tokens: int, scale: float, weight: float = 0.5, spread: float = 1.5) -> np.ndarray:
    """`[q_heads, units]`: `weight * quest_bound + (1 - weight) * moment_score`."""
    out = np.float32(1.0 - weight) * moment_score(query, key_mean, key_min, key_max, unit_tokens, scale, spread)
    if weight:
        out += np.float32(weight) * quest_bound(query, key_min, key_max)
    return out


class BlendSelector(Selector):
    name = "blend"
    needs_bounds = True
    needs_mean = True

    def __init__(self, weight: float = 0.5, spread: float = 1.5) -> None:
        self.weight, self.spread = _option(self.name, "weight", weight, 1), _option(self.name, "spread", spread, 100)

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self)
        est = blend_score(step.query, s.mean[candidates], s.min[candidates], s.max[candidates], s.unit_tokens,
                          step.softmax_scale, self.weight, self.spread)
        # ranked by the heads' mean score, which orders the units as the product of the heads' estimated
        # masses (each normalised over the candidates: a constant per head) does: the heads' log
        # estimates add up, where a mean of their masses lets the head surest of a unit decide; top-p
        # adds up the heads' mean estimated mass
        return est.mean(axis=0, dtype=np.float64), estimated_mass(est, step.softmax_scale)


class LowRankSelector(Selector):
    name = "lowrank"
    needs_proj = True

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = _summaries(step, self)
        proj = s.proj[:, :step.scored_units * step.unit_tokens]
        per_unit = _unit_sums(lowrank_mass(step.query, s.basis, proj, step.softmax_scale), step, candidates)
        return per_unit, per_unit


def interleaved_rank(first: np.ndarray, second: np.ndarray, share: float) -> np.ndarray:
    """One ranking (higher is better) of the candidates two rankings rank:
    any best-first prefix of it takes about `share` of its units from
    `second`'s best and the rest from `first`'s, each unit at the better of
    its two places (a unit both rank high is taken once, and the next of
    either list fills its place). At `share` 0 it is `first`'s order, at 1
    `second`'s; ties go to `first`."""
    n = first.shape[0]
    out = np.full(n, np.inf)
    for ranking, weight, nudge in ((first, 1.0 - share, 0.0), (second, share, 0.25)):
        if weight > 0:
            place = np.empty(n)
            place[np.argsort(-np.asarray(ranking), kind="stable")] = np.arange(n)
            out = np.minimum(out, (place + 0.5) / weight + nudge)
    return -out


class HybridSelector(Selector):
    name = "hybrid"
    needs_bounds = True
    needs_proj = True

    def __init__(self, quest_share: float = 0.25) -> None:
        self.quest_share = _option(self.name, "quest_share", quest_share, 1)
        self._lowrank, self._quest = LowRankSelector(), QuestSelector()

    def score(self, step: LayerStep, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _summaries(step, self)  # refused in its own name, before either part reads them
        low, low_mass = self._lowrank.score(step, candidates)
        quest, _ = self._quest.score(step, candidates)
        return interleaved_rank(low, quest, self.quest_share), low_mass


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
                                                           MomentSelector, BlendSelector, LowRankSelector,
                                                           HybridSelector, SinkLocalSelector, RandomSelector)}


def make_selector(name: str, **options: Any) -> Selector:
    """The selector called `name`; ConfigError naming the known ones."""
    cls = SELECTORS.get(name)
    if cls is None:
        raise ConfigError(f"unknown sparse selector {name!r}; known: {sorted(SELECTORS)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"sparse selector {name!r}: bad options {sorted(options)}: {exc}") from None
