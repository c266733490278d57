"""Counters: the whole-cache and per-tier counts behind `stats()`.

Counts are named in one `Counter` under a leaf lock: whole-cache counts
(`loaded_blocks`, `stored_blocks`, ...) and per-tier ones filed as
`name.tier` (`range_bytes.<tier>`, `served_blocks.<tier>`), which `stats()`
moves under `tiers[<tier>]`. Any thread may count.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable

# The whole-cache counts `stats()` always reports (0 until counted).
REPORTED = ("lookups", "loaded_blocks", "missing_blocks", "corrupt", "failed", "stored_blocks",
            "store_refused", "bytes_loaded", "bytes_stored", "headroom_evictions",
            "finished_requests", "slot_evictions", "range_blocks")


class Counters:
    """add, add_served, snapshot."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def add_served(self, tiers: Iterable[str]) -> None:
        """One served block per name: the tier a load, lease or range read
        took the block from (`stats()["tiers"][name]["served_blocks"]`;
        `hits` is the placement's, filed under the tier that holds the
        block once the request used it, after any promotion)."""
        with self._lock:
            for name in tiers:
                self._counts[f"served_blocks.{name}"] += 1

    def snapshot(self) -> dict[str, int]:
        """Every count now, the REPORTED ones present even at 0."""
        with self._lock:
            counts = dict(self._counts)
        for k in REPORTED:
            counts.setdefault(k, 0)
        return counts
