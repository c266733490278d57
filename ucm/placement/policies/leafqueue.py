"""LeafQueues: priority queues over one tier's blocks that offer leaves only.

A policy that orders blocks by something other than recency (insertion
order, frequency, predicted value) meets the prefix tree at every eviction:
a parent with resident children is not evictable, and old parents (a shared
system prompt, the first turns of a long conversation) would sit at the
front of its order and be skipped again and again. LeafQueues parks such a
parent out of its queue and puts it back when its last resident child in
the tier leaves, so finding the lowest evictable block stays O(log n)
amortised.

The policy learns parents from the HeatTracker (`heat.parent(key)` when the
block enters the tier). The cache's `evictable` predicate stays the judge: a
block it refuses for another reason (pinned, or the parent of the block
being inserted) is skipped for that call only.

Priorities are any comparable values, lowest first; each block is in one of
`queues` queues. Heaps with lazy invalidation: an entry is live while it
matches the block's current (queue, priority).

Native twin: LeafQueues in cpp/include/ucm/leaf_queues.hpp, under the native
policies, offers blocks in the same order and parks the same parents; a
change here must be made there too, and tests/unit/test_placement_native.py
compares the two.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Optional

from ucm.placement.heat import HeatTracker, Key


class LeafQueues:
    def __init__(self, heat: HeatTracker, queues: int = 1) -> None:
        self._heat = heat
        self._heaps: list[list[tuple[Any, Key]]] = [[] for _ in range(queues)]
        self._where: dict[Key, tuple[int, Any]] = {}  # key -> (queue, priority)
        self._parent: dict[Key, Optional[Key]] = {}
        self._kids: dict[Key, set[Key]] = {}  # parent -> its resident children here
        self._parked: dict[Key, None] = {}  # ordered, so runs are reproducible

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: Key) -> bool:
        return key in self._where

    def queue_of(self, key: Key) -> Optional[int]:
        w = self._where.get(key)
        return None if w is None else w[0]

    def priority(self, key: Key) -> Any:
        return self._where[key][1]

    def nonempty(self):
        """The queues with entries (live or stale), lowest first, each
        checked when the iteration reaches it."""
        heaps = self._heaps
        for q in range(len(heaps)):
            if heaps[q]:
                yield q

    def add(self, key: Key, queue: int, priority: Any) -> None:
        """A block entered the tier."""
        if key in self._where:
            self.update(key, queue, priority)
            return
        parent = self._heat.parent(key)
        self._parent[key] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)
        self._where[key] = (queue, priority)
        self._push(key, queue, priority)

    def update(self, key: Key, queue: int, priority: Any) -> None:
        """Moves a resident block to `queue` with a new priority."""
        if key not in self._where:
            return
        self._where[key] = (queue, priority)
        if key not in self._parked:
            self._push(key, queue, priority)

    def wake(self, key: Key) -> None:
        """Puts a parked block back in its queue: the policy's own predicate
        may now pass it (it stays a candidate until `head` parks it again)."""
        if key in self._parked:
            del self._parked[key]
            q, prio = self._where[key]
            self._push(key, q, prio)

    def remove(self, key: Key) -> None:
        """A block left the tier."""
        if self._where.pop(key, None) is None:
            return
        self._parked.pop(key, None)
        parent = self._parent.pop(key)
        if parent is None:
            return
        kids = self._kids.get(parent)
        if kids is not None:
            kids.discard(key)
            if not kids:
                del self._kids[parent]
                if parent in self._parked:  # its last child left: a candidate again
                    del self._parked[parent]
                    q, prio = self._where[parent]
                    self._push(parent, q, prio)

    def head(self, queue: int, evictable: Callable[[Key], bool]) -> Optional[tuple[Any, Key]]:
        """(priority, key) of the lowest block of `queue` that passes
        `evictable`, left in place, or None. A block that fails it while it
        has resident children here is parked until the last one leaves (or
        `wake`)."""
        heap = self._heaps[queue]
        where, parked, kids = self._where, self._parked, self._kids
        heappop = heapq.heappop
        skipped: Optional[list[tuple[Any, Key]]] = None
        found: Optional[tuple[Any, Key]] = None
        while heap:
            prio, key = item = heap[0]
            w = where.get(key)
            if w is None or w[0] != queue or w[1] != prio or key in parked:
                heappop(heap)  # stale
                continue
            if evictable(key):
                found = item
                break
            heappop(heap)
            if kids.get(key):
                parked[key] = None  # back when its last child leaves
            elif skipped is None:
                skipped = [item]
            else:
                skipped.append(item)
        if skipped:
            for item in skipped:
                heapq.heappush(heap, item)
        return found

    def fallback(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        """Any evictable parked block (the cache's tree can differ from the
        one learned here, e.g. in a trace whose ids are not chained)."""
        for key in self._parked:
            if evictable(key):
                return key
        return None

    def _push(self, key: Key, queue: int, priority: Any) -> None:
        heap = self._heaps[queue]
        heapq.heappush(heap, (priority, key))
        if len(heap) > 64 + 4 * len(self._where):
            self._heaps[queue] = heap = [
                (p, k) for k, (q, p) in self._where.items() if q == queue and k not in self._parked
            ]
            heapq.heapify(heap)
