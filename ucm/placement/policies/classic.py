"""Classic eviction policies that admit everything: LRU, FIFO, LFU with aging.

They are the baselines of `ucm bench trace`. Each orders the blocks of one
tier and evicts the first evictable one in that order; "admit everything"
means write-all: every block evicted from the tier above is written below.

The cache never lets a parent with resident children go first; each order
lives in LeafQueues (ucm/placement/policies/leafqueue.py), which keeps such parents out
of the way until their last child leaves, so an eviction stays O(log n)
whatever the order.

Native twins: LruPolicy (LRU and FIFO) and LfuPolicy in cpp/src/policies.cpp
make the same decisions (`native = ...` on each class, see
ucm/placement/policies/base.py); a change here must be made there too, and
tests/unit/test_placement_native.py compares the two.
"""
from __future__ import annotations

from typing import Callable, Optional

from ucm.placement.heat import Key
from ucm.placement.policies.base import PlacementPolicy
from ucm.placement.policies.leafqueue import LeafQueues


class LruPolicy(PlacementPolicy):
    """Least recently used; admits everything (write-all on demotion).

    The order is kept in LeafQueues (priority: order of the last report), so
    parents whose children are resident are parked rather than skipped: in a
    tier that does not serve every access (an NVMe tier under DRAM) old
    parents collect at the least recent end.
    """

    name = "lru"
    native = "lru"  # its twin in cpp/src/policies.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._queue = LeafQueues(heat)
        self._seq = 0

    def on_insert(self, key: Key, size_bytes: int) -> None:
        self._seq += 1
        self._queue.add(key, 0, self._seq)

    def on_hit(self, key: Key) -> None:
        if key in self._queue:
            self._seq += 1
            self._queue.update(key, 0, self._seq)

    def on_copied_up(self, key: Key) -> None:
        self.on_hit(key)  # a use of this copy: a block reused through DRAM is not this tier's oldest

    def on_remove(self, key: Key) -> None:
        self._queue.remove(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        head = self._queue.head(0, evictable)
        return head[1] if head is not None else self._queue.fallback(evictable)


class FifoPolicy(PlacementPolicy):
    """First in, first out: hits do not reorder; admits everything.

    A parent outlives its children's insertion under FIFO too (it cannot go
    first), so the order is kept in LeafQueues, which parks such parents
    instead of skipping them at every eviction.
    """

    name = "fifo"
    native = "fifo"  # its twin in cpp/src/policies.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._queue = LeafQueues(heat)
        self._seq = 0

    def on_insert(self, key: Key, size_bytes: int) -> None:
        self._seq += 1
        self._queue.add(key, 0, self._seq)

    def on_hit(self, key: Key) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        self._queue.remove(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        head = self._queue.head(0, evictable)
        return head[1] if head is not None else self._queue.fallback(evictable)


class LfuPolicy(PlacementPolicy):
    """Least frequently used with dynamic aging (LFU-DA, Arlitt et al. 2000).

    A block's priority is `L + hits`, where `L`, the cache age, is the
    priority of the last evicted block; the lowest priority goes first, ties
    to the least recently used. Aging lets blocks that were hot once fall out
    when the workload moves on, which plain LFU never does. Hits counted are
    those while resident (the count restarts on re-insertion). Admits
    everything.
    """

    name = "lfu"
    native = "lfu"  # its twin in cpp/src/policies.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._queue = LeafQueues(heat)
        self._age = 0.0
        self._seq = 0  # access order, the tie-break
        self._hits: dict[Key, int] = {}

    def on_insert(self, key: Key, size_bytes: int) -> None:
        self._seq += 1
        self._hits[key] = 0
        self._queue.add(key, 0, (self._age, self._seq))

    def on_hit(self, key: Key) -> None:
        n = self._hits.get(key)
        if n is not None:
            self._hits[key] = n + 1
            self._seq += 1
            self._queue.update(key, 0, (self._age + n + 1, self._seq))

    def on_remove(self, key: Key) -> None:
        self._queue.remove(key)
        self._hits.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        head = self._queue.head(0, evictable)
        if head is None:
            return self._queue.fallback(evictable)
        (priority, _), key = head
        self._age = priority
        return key
