"""TinyLFU (Einziger, Friedman and Manes, 2017): frequency admission in front of LRU.

A count-min sketch (4 rows, 4-bit saturating counters) estimates how often
each key was accessed recently; after `10 x capacity-in-blocks` recorded
accesses every counter is halved, so the estimate ages. A block enters a
full tier only if its estimate beats that of the block LRU would evict; a
tier with room admits everything. The order inside the tier is plain LRU.

Accesses recorded: each new or promoted block asking for admission (the
miss, or the hit in a tier below), and each later hit; a demotion is no
access. Hashing is deterministic (no per-process salt), so runs
are reproducible.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ucm.heat import Key
from ucm.policy.base import Admission, PlacementPolicy
from ucm.policy.leafqueue import LeafQueues

ROWS = 4
COUNTER_MAX = 15
SAMPLE_FACTOR = 10  # accesses per reset, in multiples of the capacity in blocks
_MASK = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


def _mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class FrequencySketch:
    """Count-min sketch with halving, sized for `blocks` distinct keys."""

    def __init__(self, blocks: int) -> None:
        width = 1
        while width < max(16, blocks):
            width <<= 1
        self._mask = width - 1
        self._table = np.zeros((ROWS, width), dtype=np.uint8)
        self._sample = SAMPLE_FACTOR * max(1, blocks)
        self._added = 0

    def _slots(self, key: Key) -> list[int]:
        x = int.from_bytes(key, "little")
        x = (x ^ (x >> 64)) & _MASK
        return [_mix(x ^ s) & self._mask for s in _SEEDS]

    def estimate(self, key: Key) -> int:
        t = self._table
        return int(min(t[r, c] for r, c in enumerate(self._slots(key))))

    def add(self, key: Key) -> None:
        t = self._table
        slots = self._slots(key)
        low = min(int(t[r, c]) for r, c in enumerate(slots))
        if low < COUNTER_MAX:
            for r, c in enumerate(slots):  # conservative update
                if t[r, c] == low:
                    t[r, c] = low + 1
        self._added += 1
        if self._added >= self._sample:
            self._table >>= 1
            self._added //= 2


class TinyLfuPolicy(PlacementPolicy):
    name = "tinylfu"

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._queue = LeafQueues(heat)  # LRU: priority is the order of the last report
        self._seq = 0
        self._used = 0
        self._sizes: dict[Key, int] = {}
        self._block = 0  # bytes of the last block seen; admission estimates room with it
        self._sketch: Optional[FrequencySketch] = None
        self._born: dict[Key, int] = {}

    def admit(self, key: Key, why: Admission) -> bool:
        if self._sketch is None:
            return True  # empty tier: nothing to compare with yet
        if why is not Admission.DEMOTE:  # a demotion is no access
            self._sketch.add(key)
        if self._used + self._block <= self.tier.capacity_bytes:
            return True
        head = self._queue.head(0, _always)
        if head is None:
            return True
        return self._sketch.estimate(key) > self._sketch.estimate(head[1])

    def on_insert(self, key: Key, size_bytes: int) -> None:
        if self._sketch is None:
            self._sketch = FrequencySketch(max(1, self.tier.capacity_bytes // size_bytes))
        self._block = size_bytes
        self._seq += 1
        self._queue.add(key, 0, self._seq)
        self._used += size_bytes - self._sizes.get(key, 0)
        self._sizes[key] = size_bytes
        self._born[key] = self.heat.now

    def on_hit(self, key: Key) -> None:
        if key in self._queue:
            self._seq += 1
            self._queue.update(key, 0, self._seq)
            if self._born[key] != self.heat.now and self._sketch is not None:
                self._sketch.add(key)

    def on_remove(self, key: Key) -> None:
        if key in self._queue:
            self._queue.remove(key)
            self._used -= self._sizes.pop(key)
            self._born.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        head = self._queue.head(0, evictable)
        return head[1] if head is not None else self._queue.fallback(evictable)


def _always(key: Key) -> bool:
    return True
