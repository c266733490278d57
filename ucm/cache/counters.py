"""The counters of UnifiedCache and `stats()`, the figures they make.

Counters are named in one `Counter` under `_counts_lock` (a leaf lock):
whole-cache counts (`loaded_blocks`, `stored_blocks`, ...) and per-tier ones
filed as `name.tier` (`range_bytes.<tier>`, `served_blocks.<tier>`), which
`stats()` moves under `tiers[<tier>]`. The placement's own per-tier counters
(`hits`, `inserts`, `evictions`, ...) are read under the metadata lock.

A mixin of UnifiedCache (ucm/cache/unified.py), whose metadata lock, placement,
tiers and counters it uses.
"""
from __future__ import annotations

from typing import Any, Iterable


class CacheCounters:
    """stats, _count, _count_served."""

    def stats(self) -> dict[str, Any]:
        """The cache's figures (ucm.api.CacheAPI.stats): per tier the
        placement's counters, the adapter's own stats, `range_bytes` and
        `served_blocks`; the whole-cache counts; requests and accelerators."""
        with self._meta:
            p = self.placement
            tiers = {}
            for t, name in enumerate(self.tier_names):
                c = p.counters(t)
                tiers[name] = {
                    "capacity_bytes": p.capacity_bytes(t), "used_bytes": p.used_bytes(t), "blocks": p.blocks(t),
                    "hits": c.hits, "inserts": c.inserts, "evictions": c.evictions,
                    "demotions_in": c.demotions_in, "promotions_in": c.promotions_in,
                    "bytes_written": c.bytes_written,
                }
            open_requests, requests = len(self._requests), self._requests_counted
        with self._counts_lock:
            counts = dict(self._counts)
        counts["corrupt"] = counts.get("corrupt", 0) + self.tiers.corrupt
        for name, a in zip(self.tier_names, self.adapters):
            tiers[name]["adapter"] = a.stats()
            tiers[name]["range_bytes"] = counts.pop(f"range_bytes.{name}", 0)
            tiers[name]["served_blocks"] = counts.pop(f"served_blocks.{name}", 0)
        for k in ("lookups", "loaded_blocks", "missing_blocks", "corrupt", "failed", "stored_blocks",
                  "store_refused", "bytes_loaded", "bytes_stored", "headroom_evictions",
                  "finished_requests", "slot_evictions", "range_blocks"):
            counts.setdefault(k, 0)
        return {"tiers": tiers, **counts, "requests": requests, "open_requests": open_requests,
                "accelerators": self.accelerators.stats()}

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    def _count_served(self, tiers: Iterable[str]) -> None:
        """One served block per name: the tier a load, lease or range read
        took the block from (`stats()["tiers"][name]["served_blocks"]`;
        `hits` is the placement's, filed under the tier that holds the
        block once the request used it, after any promotion)."""
        with self._counts_lock:
            for name in tiers:
                self._counts[f"served_blocks.{name}"] += 1
