"""W-TinyLFU (Einziger, Friedman and Manes, ACM TOS 2017): a small LRU window
in front of a segmented LRU main area, with TinyLFU admission between them.

New blocks enter the window (1 % of the tier at first; its share then
follows Caffeine's hill climbing, below). When the tier is full and the
window is over its share, the window's oldest block is the candidate for
the main area: it moves there (with its ancestors still in the window) if
the main area has room, or if a count-min sketch (4 rows, 4-bit saturating
counters, every counter halved after `10 x capacity-in-blocks` recorded
accesses) estimates it was accessed more often recently than the main
area's victim; otherwise the candidate itself is evicted. The main area is
a segmented LRU: a block enters probation (20 % of the main area); a hit
there moves it to the protected segment (80 %), whose oldest block falls
back to probation when it is over its share. The main victim is
probation's oldest block (protected's when probation is empty). The window
catches bursts of new blocks that TinyLFU alone would refuse before they
could prove themselves; the sketch keeps one-shot blocks from flushing the
main area.

Accesses recorded in the sketch: each new or promoted block (the miss, or
the hit in a tier below), and each later hit; a demotion is no access. Every
block is stored (admission is decided inside the tier, by eviction).
Hashing is deterministic (no per-process salt), so runs are reproducible.

Native twin: TinyLfuPolicy in cpp/src/policy_tinylfu.cpp makes exactly these
decisions (the same sketch slots and halving, the same float arithmetic for
the window's share); a change here must be made there too, and
tests/unit/test_placement_native.py compares the two.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ucm.placement.heat import Key
from ucm.placement.policies.base import Admission, PlacementPolicy
from ucm.placement.policies.leafqueue import LeafQueues

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
        self.sample = SAMPLE_FACTOR * max(1, blocks)
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
        if self._added >= self.sample:
            self._table >>= 1
            self._added //= 2


WINDOW_FRACTION = 0.01  # the window's initial share of the tier, from the paper
# Hill climbing of the window's share (Caffeine): every SAMPLE_FACTOR x
# capacity-in-blocks accesses, move the share by a step, in the same direction
# if the hit ratio of the period improved on the previous one, else the other
# way; the step starts at 6.25 % of the tier and shrinks by 2 % a period.
CLIMB_STEP = 0.0625
CLIMB_DECAY = 0.98
PROTECTED_FRACTION = 0.8  # the protected segment's share of the main area
WINDOW, PROBATION, PROTECTED = 0, 1, 2


class TinyLfuPolicy(PlacementPolicy):
    name = "tinylfu"
    native = "tinylfu"  # cpp/src/policy_tinylfu.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        # Window, probation, protected; priority: order of the last report (LRU).
        self._queues = LeafQueues(heat, 3)
        self._seq = 0
        self._sizes: dict[Key, int] = {}
        self._bytes = [0, 0, 0]  # per segment
        self._block = 0  # bytes of the last block stored
        self._sketch: Optional[FrequencySketch] = None
        self._born: dict[Key, int] = {}
        self._window_share = WINDOW_FRACTION
        self._step = CLIMB_STEP
        self._period = [0, 0]  # hits, accesses in this sample period
        self._last_ratio: Optional[float] = None

    def _count(self, hit: bool) -> None:
        p = self._period
        p[0] += hit
        p[1] += 1
        if self._sketch is None or p[1] < self._sketch.sample:
            return
        ratio = p[0] / p[1]
        if self._last_ratio is not None and ratio < self._last_ratio:
            self._step = -self._step
        self._last_ratio = ratio
        self._window_share = min(1.0 - WINDOW_FRACTION,
                                 max(WINDOW_FRACTION, self._window_share + self._step))
        self._step *= CLIMB_DECAY
        p[0] = p[1] = 0

    def _move(self, key: Key, seg: int) -> None:
        old = self._queues.queue_of(key)
        size = self._sizes[key]
        self._bytes[old] -= size
        self._bytes[seg] += size
        self._seq += 1
        self._queues.update(key, seg, self._seq)

    def _window_target(self) -> float:
        return max(self._block, self._window_share * self.tier.capacity_bytes)

    def _estimate(self, key: Key) -> int:
        return 0 if self._sketch is None else self._sketch.estimate(key)

    def admit(self, key: Key, why: Admission) -> bool:
        if self._sketch is not None and why is not Admission.DEMOTE:  # a demotion is no access
            self._sketch.add(key)
            self._count(False)
        return True

    def on_insert(self, key: Key, size_bytes: int) -> None:
        if self._sketch is None:
            self._sketch = FrequencySketch(max(1, self.tier.capacity_bytes // size_bytes))
        if key in self._queues:
            self.on_remove(key)
        self._block = size_bytes
        self._seq += 1
        self._queues.add(key, WINDOW, self._seq)
        self._sizes[key] = size_bytes
        self._bytes[WINDOW] += size_bytes
        self._born[key] = self.heat.now

    def on_hit(self, key: Key) -> None:
        seg = self._queues.queue_of(key)
        if seg is None:
            return
        fresh = self._born[key] == self.heat.now  # the access that stored it
        if not fresh and self._sketch is not None:
            self._sketch.add(key)
            self._count(True)
        if seg == PROBATION and not fresh:
            self._move(key, PROTECTED)
            main = self.tier.capacity_bytes - self._window_target()
            while self._bytes[PROTECTED] > PROTECTED_FRACTION * main:
                head = self._queues.head(PROTECTED, _always)
                if head is None:
                    break
                self._move(head[1], PROBATION)
        else:
            self._move(key, seg)

    def on_remove(self, key: Key) -> None:
        seg = self._queues.queue_of(key)
        if seg is None:
            return
        self._queues.remove(key)
        self._bytes[seg] -= self._sizes.pop(key)
        self._born.pop(key, None)

    def _to_main(self, key: Key) -> None:
        """Moves a window block to probation with its ancestors still in the
        window: a parent is accessed whenever its child is, and left behind
        it could not leave the window before the child leaves the tier.
        The walk stops at a block it met already: the tracker's last-seen
        parents may form a cycle (requests [a, b] then [b, a])."""
        chain = [key]
        met = {key}
        parent = self.heat.parent(key)
        while parent is not None and parent not in met and self._queues.queue_of(parent) == WINDOW:
            chain.append(parent)
            met.add(parent)
            parent = self.heat.parent(parent)
        for k in reversed(chain):  # the child stays the most recent
            self._move(k, PROBATION)

    def _main_victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        for seg in (PROBATION, PROTECTED):
            head = self._queues.head(seg, evictable)
            if head is not None:
                return head[1]
        return None

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        main_cap = self.tier.capacity_bytes - self._window_target()
        while self._bytes[WINDOW] > self._window_target():
            head = self._queues.head(WINDOW, evictable)
            if head is None:
                break
            cand = head[1]
            if self._bytes[PROBATION] + self._bytes[PROTECTED] + self._sizes[cand] <= main_cap:
                self._to_main(cand)  # the main area has room: no contest
                continue
            other = self._main_victim(evictable)
            if other is None or self._estimate(cand) <= self._estimate(other):
                return cand
            self._to_main(cand)
            return other
        found = self._main_victim(evictable)
        if found is None:
            head = self._queues.head(WINDOW, evictable)
            found = head[1] if head is not None else None
        return found if found is not None else self._queues.fallback(evictable)


def _always(key: Key) -> bool:
    return True
