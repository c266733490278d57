"""S3-FIFO (Yang et al., SOSP 2023): three static FIFO queues.

New blocks enter a small queue S (a tenth of the tier). Leaving S, a block
that was accessed again moves to the main queue M; the others are evicted and
their keys kept in a ghost queue G. A block whose key is in G when it comes
back enters M directly. Leaving M, a block with a non-zero access count
(capped at 3) is reinserted with the count decremented; the others are
evicted. Most blocks are used once, so most leave quickly from S without
disturbing M. Admits everything.

Adaptations to the placement interface: sizes are bytes; the access that
stores a block (the `on_hit` in its inserting request) is the miss itself and
does not count; a block that is not evictable keeps its place and the scan
goes on to the next one.

Native twin: S3FifoPolicy in cpp/src/policies.cpp makes the same decisions
(`native = ...` on the class, see ucm/placement/policies/base.py); a change here must be
made there too, and tests/unit/test_placement_native.py compares the two.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from ucm.placement.heat import Key
from ucm.placement.policies.base import PlacementPolicy
from ucm.placement.policies.leafqueue import LeafQueues

SMALL_FRACTION = 0.1  # S's share of the tier, from the paper
MAX_FREQ = 3
S, M = 0, 1


class S3FifoPolicy(PlacementPolicy):
    name = "s3fifo"
    native = "s3fifo"  # its twin in cpp/src/policies.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._small_cap = SMALL_FRACTION * tier.capacity_bytes
        self._ghost_cap = tier.capacity_bytes - self._small_cap
        self._queues = LeafQueues(heat, 2)  # S, M; priority: order of (re)insertion
        self._seq = 0
        self._sizes: dict[Key, int] = {}
        self._s_bytes = 0
        self._s_count = 0  # blocks in S
        self._g: OrderedDict[Key, int] = OrderedDict()
        self._g_bytes = 0
        self._freq: dict[Key, int] = {}
        self._born: dict[Key, int] = {}

    def _enqueue(self, key: Key, q: int) -> None:
        self._seq += 1
        if key in self._queues:
            self._queues.update(key, q, self._seq)
        else:
            self._queues.add(key, q, self._seq)

    def on_insert(self, key: Key, size_bytes: int) -> None:
        if key in self._g:
            self._g_bytes -= self._g.pop(key)
            self._enqueue(key, M)
        else:
            self._enqueue(key, S)
            self._s_bytes += size_bytes
            self._s_count += 1
        self._sizes[key] = size_bytes
        self._freq[key] = 0
        self._born[key] = self.heat.now

    def on_hit(self, key: Key) -> None:
        f = self._freq.get(key)
        if f is not None and self._born[key] != self.heat.now and f < MAX_FREQ:
            self._freq[key] = f + 1
            if f == 0:
                self._queues.wake(key)  # now due to move on even if it cannot go

    def on_remove(self, key: Key) -> None:
        q = self._queues.queue_of(key)
        if q is None:
            return
        self._queues.remove(key)
        self._freq.pop(key, None)
        self._born.pop(key, None)
        size = self._sizes.pop(key)
        if q == S:
            self._s_bytes -= size
            self._s_count -= 1
            self._g[key] = size
            self._g_bytes += size
            while self._g_bytes > self._ghost_cap and self._g:
                self._g_bytes -= self._g.popitem(last=False)[1]

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        freq = self._freq

        def candidate(key: Key) -> bool:  # due for a decision: to move on, or to go
            return freq[key] > 0 or evictable(key)

        for _ in range(MAX_FREQ + 2):
            if self._s_bytes >= self._small_cap or len(self._sizes) == self._s_count:
                while (head := self._queues.head(S, candidate)) is not None:
                    key = head[1]
                    if freq[key] == 0:
                        return key
                    self._enqueue(key, M)  # accessed again while in S: on to M
                    self._s_bytes -= self._sizes[key]
                    self._s_count -= 1
                    freq[key] = 0
            while (head := self._queues.head(M, candidate)) is not None:
                key = head[1]
                if freq[key] == 0:
                    return key
                freq[key] -= 1
                self._enqueue(key, M)  # second chance
            if self._queues.head(S, evictable) is not None:
                return self._queues.head(S, evictable)[1]
        return self._queues.fallback(evictable)
