"""ReuseModel: how likely a block is to be used again, learned from the access stream.

A listener of the HeatTracker (`ReuseModel.of(tracker)` subscribes one per
tracker, shared by every policy of a cache): it learns from the tracker's
access, tick, forget and reclass events (hits and misses alike, so what it
learns does not depend on what a cache kept; the tracker's history plays the
ghost list), reads the tracker's records and never writes them; read by the
heat policy. Runs under the owner's lock like the tracker; never blocks.

Blocks are grouped into classes by four facts that predict reuse of KV blocks:
- how often the block was used: once, twice, or three times or more. Most
  blocks are used once, while a block that came back tends to come back
  again; a shared prefix (a system prompt, a template) is used by many
  requests and soon reaches three uses, while a conversation's context is
  reused once per turn. Lifetime counts also measure old popularity, and
  finer classes split the evidence thinner; the hazard by age (below)
  carries the rest;
- for a block used once, whether its parent had been seen before: new text
  behind a known prefix (a question after a template, a retrieved chunk
  after shared headers, a conversation's new turn) has another fate than
  text that arrived with a new prefix (a new document or template, which
  the next request may send again); which fate is the likelier one is
  learned, not assumed. Only the first block of such text is told apart:
  the blocks after it have a new parent (keeping the rest of a continuing
  request's new text apart too was measured, docs/lab/trace_bench.md, and not
  kept);
- whether its last access was the deepest block of its request. A
  conversation's next turn extends the prompt, which rewrites the last,
  partly filled block (new id), while the blocks before it are reused; a
  workload whose prompts end on block boundaries simply shows no difference
  between the two;
- how long an answer the last request that used it generated, when the
  engine reports it (`HeatTracker.finish`): under `LONG_OUTPUT` tokens (a
  label, an extraction, a tool call, a short answer over a document) or
  more (a summary, an essay, a chat reply). The two are different jobs,
  and jobs differ in whether their prompts come back: documents queried
  again and again get short answers, one-shot summarisation long ones. A
  new block takes its parent's kind until its own request reports; which
  kind is reused more, if either, is learned; without reports every block
  stays in the first kind.
Per class and per age bucket (ticks since the last access: [0,2), [2,4),
[4,8), ...) it measures the reuse hazard: reuses that happened at that age
divided by the block-ticks spent alive at that age (blocks not yet reused;
an estimate that handles blocks still waiting). Estimates are regularised
(see `hazard`): a proportional-hazards prior, one age profile pooled over
classes times a rate per class fitted mostly on young ages (the freshest
evidence), updated by each cell's own counts; and at any age a block used
more often is never rated below one used less.

From hazards, `density(horizon)` gives each (class, age bucket) its hit
density (Beckmann et al., LHD, NSDI 2018): the probability of a reuse within
the next `horizon` ticks divided by the expected ticks the block occupies
the cache meanwhile: hits per unit of space-time, the currency of eviction.

Native twin: ReuseModel in cpp/src/reuse_model.cpp (ucm/reuse_model.hpp),
the model of the native heat policy, keeps the same counts from the same
events; a change here must be made there too. The hazard and density
tables have one implementation, in C++ (`ucm._native.reuse_hazard` and
`reuse_density`), which this model uses whenever ucm._native is importable,
so both engines value blocks with the same numbers; `estimate_hazard` and
`density_table` are their numpy twins, the fallback when it is not (they
agree to rounding, tests/unit/policy/test_heat_policy.py).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional

import numpy as np

from ucm.placement.heat import EXT, LONG_OUT, LONG_OUTPUT, TAIL, HeatTracker, Key

try:  # the one implementation of the hazard and density tables (cpp/src/reuse_model.cpp)
    from ucm import _native
except ImportError:  # not built: the numpy twins below
    _native = None
if _native is not None and not hasattr(_native, "reuse_density"):  # built before the tables moved there
    _native = None

__all__ = ["AGE_BUCKETS", "LONG_OUTPUT", "NUM_CLASSES", "USE_KINDS", "ReuseModel", "age_bucket",
           "class_of", "classify"]

# How often a block was used: once behind an unseen prefix, once behind a
# prefix seen before, twice, three times or more.
USE_KINDS = 4
NUM_CLASSES = 4 * USE_KINDS  # x (last access ended its request or not) x (long output or not)
AGE_BUCKETS = 20  # ages up to 2**20 ticks (requests); the last bucket is open


def classify(count: int, tail: bool, ext: bool = False, long_out: bool = False) -> int:
    """The class of a block accessed `count` times, the last time as the
    deepest block of its request if `tail`, by a request that generated a
    long answer if `long_out`; a block used once is told apart by `ext`,
    whether its parent had been seen before that use."""
    kind = (1 if ext else 0) if count <= 1 else min(count, 3)
    return kind + (USE_KINDS if tail else 0) + (2 * USE_KINDS if long_out else 0)


def class_of(heat: HeatTracker, slot: int) -> int:
    """The class of the record in `slot` of `heat` as the tracker knows it now
    (`classify` of its count and flags)."""
    n = heat.count[slot]
    f = heat.flags[slot]
    kind = (1 if f & EXT else 0) if n <= 1 else (2 if n == 2 else 3)
    return kind + (USE_KINDS if f & TAIL else 0) + (2 * USE_KINDS if f & LONG_OUT else 0)


def age_bucket(age: int) -> int:
    """[0,2) -> 0, [2,4) -> 1, [4,8) -> 2, ... capped at AGE_BUCKETS - 1."""
    return min(max(age.bit_length() - 1, 0), AGE_BUCKETS - 1)


PRIOR_EVENTS = 1.0  # strength of each shrinkage prior, in reuse events

_START = [0] + [1 << i for i in range(1, AGE_BUCKETS)]  # first age of each bucket
_START_F = np.array(_START, dtype=float)
_END_F = np.array(_START[1:] + [math.inf], dtype=float)  # the last bucket is open
_CELLS = NUM_CLASSES * AGE_BUCKETS


class ReuseModel:
    """Reuse hazard per (class, age bucket), learned online from a tracker's events.

    Counts are kept flat per (class x AGE_BUCKETS + bucket) in Python lists on
    the per-access path and folded into the numpy tables (`events`,
    `exposure`) once a tick; every count is a whole number, so the tables are
    exact either way.
    """

    def __init__(self, heat: Optional[HeatTracker] = None) -> None:
        self._heat = heat
        self._events = np.zeros((NUM_CLASSES, AGE_BUCKETS))  # reuses seen at that age
        self.exposure = np.zeros((NUM_CLASSES, AGE_BUCKETS))  # block-ticks alive at that age
        self._new_events = [0.0] * _CELLS  # reuses since the last fold into `events`
        self._alive_flat = [0.0] * _CELLS  # blocks waiting, by age now
        # _waiting[i]: episodes (start, slot) that may cross into bucket i.
        self._waiting: list[deque] = [deque() for _ in range(AGE_BUCKETS)]
        self._dirty = False
        self.version = 0  # bumped every tick: tables derived from the model go stale
        self._hazard: Optional[np.ndarray] = None
        self._hazard_version = -1

    @classmethod
    def of(cls, heat: HeatTracker) -> "ReuseModel":
        """The model subscribed to `heat`, subscribing a new one at the first
        call; every policy of a cache shares it."""
        model = heat.listener(cls)
        if model is None:
            model = cls(heat)
            heat.subscribe(model)
        return model

    # ---- tables ----------------------------------------------------------------
    def _fold(self) -> None:
        if self._dirty:
            self._events += np.array(self._new_events).reshape(NUM_CLASSES, AGE_BUCKETS)
            self._new_events = [0.0] * _CELLS
            self._dirty = False

    @property
    def events(self) -> np.ndarray:
        """Reuses seen per (class, age bucket)."""
        self._fold()
        return self._events

    @property
    def alive(self) -> np.ndarray:
        """Blocks waiting for their next use now, per (class, age bucket) (a copy)."""
        return np.array(self._alive_flat).reshape(NUM_CLASSES, AGE_BUCKETS)

    # ---- HeatTracker events ------------------------------------------------------
    def on_access(self, key: Key, slot: int, now: int, first: bool, ext: bool) -> None:
        """`key` is accessed at `now`, as the deepest block of its request if
        `first`, behind a parent seen before if `ext`; its record still shows
        the previous access (its output kind stays until a reclass)."""
        heat = self._heat
        last = heat.last[slot]
        n = heat.count[slot]
        f = heat.flags[slot]
        alive = self._alive_flat
        if last >= 0:  # ends the episode that began at the last access
            c = class_of(heat, slot)
            age = now - last
            i = c * AGE_BUCKETS + (min(age.bit_length() - 1, AGE_BUCKETS - 1) if age > 1 else 0)
            self._new_events[i] += 1.0
            self._dirty = True
            alive[i] -= 1.0
        n += 1
        kind = (1 if ext else 0) if n <= 1 else (2 if n == 2 else 3)
        c = kind + (USE_KINDS if first else 0) + (2 * USE_KINDS if f & LONG_OUT else 0)
        alive[c * AGE_BUCKETS] += 1.0
        self._waiting[1].append((now, slot))

    def on_reclass(self, key: Key, slot: int, now: int, long_out: bool) -> None:
        """The request that last used `key` reported its output kind: the
        block's waiting episode moves to that class from now on (its
        exposure so far stays where it was counted)."""
        heat = self._heat
        last = heat.last[slot]
        if last >= 0 and bool(heat.flags[slot] & LONG_OUT) != long_out:
            b = age_bucket(now - last)
            c = class_of(heat, slot)
            self._alive_flat[c * AGE_BUCKETS + b] -= 1.0
            self._alive_flat[(c ^ (2 * USE_KINDS)) * AGE_BUCKETS + b] += 1.0

    def on_forget(self, key: Key, slot: int, now: int) -> None:
        """The tracker drops the record of `key`: its episode ends unseen."""
        heat = self._heat
        last = heat.last[slot]
        if last >= 0:
            self._alive_flat[class_of(heat, slot) * AGE_BUCKETS + age_bucket(now - last)] -= 1.0
            if last == now:  # its episode began this tick: the slot may be reused at once
                try:
                    self._waiting[1].remove((now, slot))
                except ValueError:
                    pass

    def on_tick(self, now: int) -> None:
        """The clock reached `now` (before any access at `now`): moves waiting
        blocks across age buckets, then counts one tick of exposure."""
        heat = self._heat
        last_of = heat.last
        alive = self._alive_flat
        for i in range(1, AGE_BUCKETS):
            q = self._waiting[i]
            edge = now - _START[i]
            nxt = self._waiting[i + 1] if i + 1 < AGE_BUCKETS else None
            while q and q[0][0] <= edge:
                ep = q.popleft()
                start, slot = ep
                if last_of[slot] == start:  # not used since: now older than _START[i]
                    c = class_of(heat, slot) * AGE_BUCKETS + i
                    alive[c - 1] -= 1.0
                    alive[c] += 1.0
                    if nxt is not None:
                        nxt.append(ep)
        self.exposure += np.array(alive).reshape(NUM_CLASSES, AGE_BUCKETS)
        self.version += 1

    # ---- read by policies --------------------------------------------------
    def hazard(self) -> np.ndarray:
        """Reuses per tick, per (class, age bucket).

        Prior: proportional hazards, `rate(c, a) = m(c) x base(a)`, the age
        profile `base` pooled over classes and each class's multiplier `m`
        fitted on all its ages (mostly young ones, the freshest evidence).
        Each (class, age) estimate is that prior updated with the cell's own
        reuses and exposure (one pseudo-event of prior weight), so a cell with
        little evidence (old ages, rare classes) follows the prior. Finally,
        at each age, more accesses never predict a lower rate (isotonic in
        the access count). Cached until the next tick."""
        if self._hazard is not None and self._hazard_version == self.version:
            return self._hazard
        self._hazard = self._estimate()
        self._hazard_version = self.version
        return self._hazard

    def _estimate(self) -> np.ndarray:
        if _native is not None:
            return np.array(_native.reuse_hazard(self.events, self.exposure))
        return estimate_hazard(self.events, self.exposure)

    def density(self, horizon: float) -> list[list[float]]:
        """Hit density per (class, age bucket) over the next `horizon` ticks,
        for a block at the first age of the bucket: P(reuse within the
        horizon) / expected ticks occupied meanwhile, with the hazard
        constant within each age bucket (`density_table`)."""
        lam = self.hazard()  # (classes, buckets)
        if _native is not None:
            return _native.reuse_density(lam, float(horizon))
        return density_table(lam, horizon)


def estimate_hazard(ev: np.ndarray, ex: np.ndarray) -> np.ndarray:
    """ReuseModel.hazard from reuses `ev` and exposure `ex` per (class, age
    bucket), in numpy: the fallback of ucm._native.reuse_hazard, which the
    model uses whenever the native core is built (both engines then value
    blocks with the same numbers; they agree with this to rounding)."""
    total_ev, total_ex = ev.sum(), ex.sum()
    if total_ev <= 0 or total_ex <= 0:
        return np.zeros_like(ev)
    overall = total_ev / total_ex
    base = (ev.sum(axis=0) + PRIOR_EVENTS) / (ex.sum(axis=0) + PRIOR_EVENTS / overall)
    mult = (ev.sum(axis=1) + PRIOR_EVENTS) / ((ex * base[None, :]).sum(axis=1) + PRIOR_EVENTS)
    prior = mult[:, None] * base[None, :]
    out = (ev + PRIOR_EVENTS) / (ex + PRIOR_EVENTS / prior)
    for tail in (False, True):
        for long_out in (False, True):
            twice, more = classify(2, tail, False, long_out), classify(3, tail, False, long_out)
            for ext in (False, True):
                np.maximum(out[twice], out[classify(1, tail, ext, long_out)], out=out[twice])
            np.maximum(out[more], out[twice], out=out[more])
    return out


def density_table(lam: np.ndarray, horizon: float) -> list[list[float]]:
    """ReuseModel.density from the hazards `lam`, in numpy: the fallback of
    ucm._native.reuse_density (see `estimate_hazard`)."""
    horizon = max(1.0, float(horizon))
    start = _START_F[:, None]  # rows: the bucket the block is in now
    end = start + horizon
    lo = np.maximum(_START_F[None, :], start)  # columns: buckets crossed
    hi = np.minimum(_END_F[None, :], end)
    span = np.clip(hi - lo, 0.0, None)  # (j, i) ticks spent in bucket i
    exposure = lam[:, None, :] * span[None, :, :]  # (c, j, i)
    before = np.cumsum(exposure, axis=2) - exposure  # hazard accumulated before i
    surv_in = np.exp(-before)
    with np.errstate(divide="ignore", invalid="ignore"):
        piece = np.where(lam[:, None, :] > 0,
                         -np.expm1(-exposure) / lam[:, None, :], span[None, :, :])
    occupied = (surv_in * piece).sum(axis=2)
    p_hit = -np.expm1(-exposure.sum(axis=2))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(occupied > 0, p_hit / occupied, 0.0)
    return out.tolist()
