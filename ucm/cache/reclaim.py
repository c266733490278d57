"""The headroom thread: room made in a tier ahead of need.

A tier configured with `headroom` keeps that fraction of its capacity free,
so a store or a staging copy into it rarely waits for an eviction. One
background thread per cache, woken after every operation that adds blocks,
demotes a few victims at a time (`step` returns whether it did anything)
until every such tier has its headroom, so foreground operations are never
held up behind a long run of writes.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

from ucm.cache.core import CacheCore
from ucm.placement.plans import Op

log = logging.getLogger(__name__)

VICTIMS_PER_STEP = 4  # victims planned per tier and step: the metadata lock is held only that long


class HeadroomReclaimer:
    """Runs `step()` on its own thread while it returns True, after each
    `wake()`; an exception is logged, never kills the thread. `headroom`:
    (tier, bytes kept free) per tier that keeps headroom."""

    def __init__(self, core: CacheCore, headroom: Sequence[tuple[int, int]], name: str = "ucm-reclaim") -> None:
        self._core = core
        self._headroom = list(headroom)
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def run_now(self) -> None:
        """Makes the headroom on the caller's thread (a flush)."""
        while not self._closed and self.step():
            pass

    def step(self) -> bool:
        """One round: up to VICTIMS_PER_STEP victims per tier short of its
        headroom, planned under the metadata lock and demoted without it.
        True when something was evicted (call again)."""
        core = self._core
        did = False
        for t, free in self._headroom:
            if core.closed or self._closed:
                return False
            with core.meta:
                plan = core.placement.reclaim(t, free, max_victims=VICTIMS_PER_STEP)
                ticket = core.plans.admit(plan) if plan else None
            if ticket is not None:
                did = True
                core.counters.add("headroom_evictions", sum(s.src == t and s.op in (Op.MOVE, Op.DROP) for s in plan))
                core.plans.run(ticket, {})
        core.plans.drain_dropped()
        return did

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                self.run_now()
            except Exception:  # a failed demotion is a lost block, never a dead thread
                log.exception("ucm: making headroom failed")
