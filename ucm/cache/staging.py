"""Stager: copying blocks held only below the landing tier up into it
(`prefetch`, a reader's `acquire`, a streamed load), and joining a staging
that another caller runs for the same block.

Acts on the cache's core (ucm/cache/core.py); the blocks being staged now
are its own state, guarded by the core's metadata lock.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

from ucm.api import Key, Outcome
from ucm.cache.core import CacheCore
from ucm.placement.plans import Op, Plan
from ucm.tiers.stack import BatchRead

log = logging.getLogger(__name__)

# How long a staging waits for another staging's copy of a block it needs.
STAGE_JOIN_TIMEOUT_S = 30.0


class Stager:
    """prefetch, stage."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._staging: dict[Key, threading.Event] = {}  # block -> the staging copying it now (under core.meta)

    def prefetch(self, keys: list[Key]) -> list[Outcome]:
        """Stages the blocks the policy lets in; DONE for a block in the
        landing tier, its copy landed."""
        core = self._core
        core.plans.adopt_shared(keys, range(len(keys)))
        self.stage(keys, force=False)
        with core.meta:
            landing = core.placement.landing
            out = [Outcome.DONE if core.placement.where(k) == landing and k not in self._staging
                   else Outcome.MISSING for k in keys]
        core.plans.drain_dropped()
        core.wake_reclaim()
        return out

    def stage(self, keys: Sequence[Key], force: bool, then: Optional[Callable[[], Any]] = None,
              read: Optional[BatchRead] = None, planned: Optional[Callable[[list[Key]], Any]] = None) -> None:
        """Copies the blocks of `keys` held only below the landing tier up
        into it (`force`: without asking the policy, for a reader). Every
        promotion is planned first under one hold of the metadata lock, so that the
        evictions they need run before, and the reads as one batch per
        source tier (in parallel on the adapter's I/O threads) instead of
        one block at a time. The staged blocks are held until `then()` ran
        (a reader leases them there), so nothing evicts them before.
        `read` replaces the batched read (a streamed load's layer reads).
        `planned(others)`, once the copies are planned and before they run:
        the keys this call does not copy itself (joined, in the landing
        tier already, or nowhere), so a streamed load need not wait for
        the whole run to learn their slots.

        A block another staging is copying right now (placed in the landing
        tier, its copy not landed) is joined, not skipped: this call returns
        only once that copy ended too (at most STAGE_JOIN_TIMEOUT_S), so a
        second prefetch of a block never reports it DONE before its bytes
        are there. A staging marks its copies landed as soon as its run
        ends, before it joins others, so two stagings never wait on each
        other."""
        core = self._core
        landing = core.placement.landing
        plan: Plan = []
        staged: list[Key] = []
        joined: list[threading.Event] = []
        landed = threading.Event()
        with core.meta:
            for key in keys:
                src = core.placement.where(key)
                if src is None or src <= landing:
                    ev = self._staging.get(key)
                    if ev is not None and ev not in joined:
                        joined.append(ev)
                    continue
                d = core.placement.promote(key, force=force)
                plan.extend(d.plan)
                if d.placed:  # later promotions must not pick it as a victim before its copy
                    core.placement.hold([key])
                    staged.append(key)
                    self._staging[key] = landed
            # The evictions first, then the copies as one run (one batched read
            # per source tier); the staged blocks are held, so no eviction names one.
            plan = [s for s in plan if s.op is not Op.COPY] + [s for s in plan if s.op is Op.COPY]
            ticket = core.plans.admit(plan)
        try:
            try:
                if planned is not None:
                    mine = set(staged)
                    try:
                        planned([k for k in keys if k not in mine])
                    except Exception:  # the admitted steps must still run: later operations on the keys wait for them
                        log.exception("ucm: a staging's planned() callback failed; the staging goes on")
                core.plans.run(ticket, {}, read)
            finally:
                with core.meta:
                    for key in staged:
                        if self._staging.get(key) is landed:
                            del self._staging[key]
                landed.set()
            for ev in joined:
                if not ev.wait(STAGE_JOIN_TIMEOUT_S):
                    log.warning("ucm: a staging joined by another took over %.0f s", STAGE_JOIN_TIMEOUT_S)
                    break
            if then is not None:
                then()
        finally:
            with core.meta:
                core.placement.unhold(staged)
