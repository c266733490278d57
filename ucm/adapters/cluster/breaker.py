"""`CircuitBreaker`: when a cluster tier stops calling its server.

A dead server costs a client seconds per call (connect and RPC timeouts).
The breaker lets an adapter answer at once instead: after a call saw the
server unreachable (`trip`) every call is refused for `retry_after_s`, and
while a health probe says the server is down (`probed(False)`) until it says
it is back. `allows()` is the one question the data path asks.

Each outage (the first trip after calls were allowed, or a probe that turns
unhealthy) is counted in `outages` and logged once, not per call; every call
`allows()` refused (answered without the server) is counted in `refused`.

Thread-safe: one lock of its own, never held while calling out.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ucm.errors import ArgumentError

log = logging.getLogger(__name__)


class CircuitBreaker:
    """'Down until' after a failure, plus the health a probe reports."""

    def __init__(self, tier: str, target: str, retry_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`tier` and `target` name the adapter and its server in logs (the
        target without credentials)."""
        if retry_after_s < 0:
            raise ArgumentError(f"{tier}: retry_after_s must be >= 0, got {retry_after_s}")
        self._tier = tier
        self._target = target
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = float("-inf")
        self._healthy = True
        self._outages = 0
        self._refused = 0

    def allows(self) -> bool:
        """Whether a call may go to the server now (a refusal is counted)."""
        with self._lock:
            ok = self._allows_locked()
            if not ok:
                self._refused += 1
            return ok

    def _allows_locked(self) -> bool:
        return self._healthy and self._clock() >= self._down_until

    def trip(self, cause: object) -> None:
        """A call found the server unreachable: refuse calls for
        `retry_after_s` from now."""
        with self._lock:
            now = self._clock()
            first = now >= self._down_until
            self._down_until = now + self._retry_after_s
            if first:
                self._outages += 1
        if first:
            log.warning("%s: %s unreachable (%s); answering misses for %.1fs", self._tier, self._target,
                        cause, self._retry_after_s)

    def probed(self, ok: bool) -> None:
        """A health probe's answer: calls are refused while it is False."""
        with self._lock:
            was, self._healthy = self._healthy, ok
            if was and not ok:
                self._outages += 1
        if was and not ok:
            log.warning("%s: %s unreachable; answering misses", self._tier, self._target)
        elif ok and not was:
            log.info("%s: %s is back", self._tier, self._target)

    @property
    def healthy(self) -> bool:
        """What the last probe said (True before any)."""
        with self._lock:
            return self._healthy

    @property
    def down(self) -> bool:
        """Whether calls are refused now (asking counts no refusal)."""
        with self._lock:
            return not self._allows_locked()

    @property
    def outages(self) -> int:
        with self._lock:
            return self._outages

    @property
    def refused(self) -> int:
        """The calls `allows()` refused."""
        with self._lock:
            return self._refused
