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
from typing import Callable

log = logging.getLogger(__name__)


class HeadroomReclaimer:
    """Runs `step()` on its own thread while it returns True, after each
    `wake()`. `step` must plan under the owner's lock and run the plan
    without it; an exception is logged, never kills the thread."""

    def __init__(self, step: Callable[[], bool], name: str = "ucm-reclaim") -> None:
        self._step = step
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def run_now(self) -> None:
        """Makes the headroom on the caller's thread (a flush)."""
        while not self._closed and self._step():
            pass

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
