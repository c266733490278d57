"""CallGuard: the transformers connector's calls into a cache, where a fault
is a miss, and the connector's counters.

Every call the connector and its restore path make into the shared cache or
the hbm front goes through `call`: an exception is logged (a warning the
first time for each kind of call, then at debug level), counted as a fault
and answered with a default, so the model recomputes and nothing raises into
`generate`. Thread-safe: the caller's thread and the connector's store
thread both count.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

COUNTERS = ("requests", "lookup_blocks", "hit_blocks", "front_hit_blocks", "restored_tokens", "load_failed_blocks",
            "stored_blocks", "store_failed_blocks", "faults")


class CallGuard:
    """Faults as misses, warnings once per kind, and counters (module docstring)."""

    def __init__(self, log: logging.Logger) -> None:
        """`log`: where faults and warnings go (the connector's logger)."""
        self._log = log
        self._lock = threading.Lock()  # guards the counters and the kinds warned of
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._warned: set[str] = set()

    def call(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """`fn()`, or `default` after logging when it raises: a cache fault
        is a miss, never an exception in generate."""
        try:
            return fn()
        except Exception:
            self.fault(what, f"ucm: {what} raised; treated as a miss")
            return default

    def fault(self, what: str, message: str) -> None:
        """Counts a fault and logs `message` with the exception being handled
        (a warning the first time for `what`)."""
        with self._lock:
            self._counters["faults"] += 1
            first = what not in self._warned
            self._warned.add(what)
        if first:
            self._log.warning(message, exc_info=True)
        else:
            self._log.debug(message, exc_info=True)

    def warn_once(self, what: str, message: str) -> None:
        """Logs `message` as a warning the first time for `what` only."""
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        if first:
            self._log.warning(message)

    def count(self, name: str, n: int) -> None:
        """Adds `n` to the counter `name` (one of COUNTERS)."""
        with self._lock:
            self._counters[name] += n

    def counts(self) -> dict[str, int]:
        """A snapshot of the counters."""
        with self._lock:
            return dict(self._counters)
