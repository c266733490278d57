"""BlockIO: whole blocks copied into and out of the tiers (`store`, `load`).

The data path of UnifiedCache.store / load (and of the slot and stream
paths where the landing tier has no shared slots): a store's run is planned
under one hold of the metadata lock (`insert_run`, stopping at the first
refusal), then executed without it; a load reads each block from the tier
that holds it (from any tier if a demotion moved it meanwhile), promotes
what the policy promotes and forgets a copy that was bad. Runs on the
cache's I/O threads; faults are outcomes, never exceptions.
"""
from __future__ import annotations

import logging
from typing import Optional

from ucm.accelerators.base import BlocksLoaded, BlocksStored
from ucm.adapters.base import Status
from ucm.api import Key, Outcome
from ucm.cache.core import CacheCore
from ucm.placement.plans import Plan

log = logging.getLogger(__name__)

FROM_STATUS = {Status.OK: Outcome.DONE, Status.NOT_FOUND: Outcome.MISSING, Status.NO_SPACE: Outcome.MISSING,
               Status.CORRUPT: Outcome.CORRUPT, Status.FAILED: Outcome.FAILED}


class BlockIO:
    """store, load."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core

    def store(self, keys: list[Key], views: list[memoryview], parent: Optional[Key],
              request_id: Optional[str] = None, filled: Optional[list[bool]] = None) -> list[Outcome]:
        """Stores consecutive blocks of one prompt. `filled[i]` False:
        views[i] holds no bytes (the caller skipped a block it saw cached);
        the run stops before such a block unless it is still cached when
        the run is planned."""
        core = self._core
        p = core.placement
        with core.meta:
            core.record_locked(keys, parent, request_id)
            n = len(keys)
            if filled is not None:
                n = next((i for i, f in enumerate(filled) if not f and not p.contains(keys[i])), n)
            run = p.insert_run(keys[:n], parent, [core.footprint(len(v)) for v in views[:n]])
            ticket = core.plans.admit(run.plan)
        placed = run.placed[:run.stop]
        core.plans.run(ticket, dict(zip(keys, views)))
        out: list[Outcome] = []
        with core.meta:
            for i, key in enumerate(keys):
                if i < len(placed) and (not out or out[-1] is Outcome.DONE) and p.contains(key):
                    out.append(Outcome.DONE)
                else:
                    out.append(Outcome.MISSING)
            p.touch([k for k, o in zip(keys, out) if o is Outcome.DONE])
        new = [i for i, o in enumerate(out) if o is Outcome.DONE and placed[i]]
        core.counters.add("stored_blocks", len(new))
        core.counters.add("bytes_stored", sum(len(views[i]) for i in new))
        if new:
            core.write_through([keys[i] for i in new])
        if new and core.accelerators:
            core.accelerators.blocks_stored(BlocksStored(
                tuple(keys[i] for i in new), tuple(len(views[i]) for i in new),
                core.tier_names[p.landing], request_id))
        if any(o is Outcome.MISSING for o in out):
            core.counters.add("store_refused", 1)
        core.plans.drain_dropped()
        core.wake_reclaim()
        return out

    def load(self, keys: list[Key], views: list[memoryview], request_id: Optional[str] = None) -> list[Outcome]:
        """Copies each block into its view (sizes checked by the caller)."""
        core = self._core
        out: list[Optional[Outcome]] = [None] * len(keys)
        served: list[Optional[int]] = [None] * len(keys)  # the tier each block came from
        by_tier: dict[int, list[int]] = {}
        core.plans.adopt_shared(keys, range(len(keys)))
        with core.meta:
            core.record_locked(keys, None, request_id)
            for i, k in enumerate(keys):
                t = core.placement.where(k)
                if t is None:
                    out[i] = Outcome.MISSING
                else:
                    by_tier.setdefault(t, []).append(i)
            held = [keys[i] for idx in by_tier.values() for i in idx]
            core.placement.hold(held)
        promote: list[int] = []
        bad: list[tuple[Key, int]] = []
        try:
            for t, idx in sorted(by_tier.items()):
                try:
                    statuses = core.adapters[t].get([keys[i] for i in idx], [views[i] for i in idx])
                except Exception:
                    log.exception("ucm: reading %d blocks from tier %s failed", len(idx), core.tier_names[t])
                    statuses = [Status.FAILED] * len(idx)
                for i, st in zip(idx, statuses):
                    src: Optional[int] = t
                    if st is Status.NOT_FOUND:  # moved by a concurrent demotion: look everywhere
                        st, src = core.tiers.get_anywhere(keys[i], views[i], skip=t)
                    out[i] = FROM_STATUS[st]
                    served[i] = src if st is Status.OK else None
                    if st is Status.OK and src is not None and src > core.placement.landing:
                        promote.append(i)
                    elif st in (Status.CORRUPT, Status.FAILED) and src is not None:
                        bad.append((keys[i], src))  # the tier whose copy was bad
        finally:
            with core.meta:
                core.placement.unhold(held)
        for key, t in bad:
            core.plans.forget(key, t)
        if promote:
            plan: Plan = []
            with core.meta:
                for i in promote:
                    plan.extend(core.placement.promote(keys[i]).plan)
                ticket = core.plans.admit(plan)
            core.plans.run(ticket, {keys[i]: views[i] for i in promote})
        with core.meta:
            core.placement.touch([k for k, o in zip(keys, out) if o is Outcome.DONE])
        done = [o if o is not None else Outcome.FAILED for o in out]
        counters = core.counters
        counters.add_served(core.tier_names[t] for t, o in zip(served, done) if o is Outcome.DONE and t is not None)
        counters.add("loaded_blocks", sum(o is Outcome.DONE for o in done))
        counters.add("bytes_loaded", sum(len(v) for v, o in zip(views, done) if o is Outcome.DONE))
        counters.add("missing_blocks", sum(o is Outcome.MISSING for o in done))
        counters.add("corrupt", sum(o is Outcome.CORRUPT for o in done))
        counters.add("failed", sum(o is Outcome.FAILED for o in done))
        core.plans.drain_dropped()
        if core.accelerators:
            core.accelerators.blocks_loaded(BlocksLoaded(
                tuple(keys), tuple(done), tuple(None if t is None else core.tier_names[t] for t in served),
                request_id))
        return done
