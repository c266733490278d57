"""ARC: Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), in bytes.

Two resident lists, T1 (seen once recently) and T2 (seen at least twice),
and two ghost lists of keys only, B1 and B2, holding what was recently
evicted from each. A miss that hits B1 means T1 was too small: the target
size `p` of T1 grows; a B2 hit shrinks it. The victim comes from T1 while T1
is larger than `p`, else from T2, least recent first. Admits everything.

Adaptations to the placement interface: sizes are bytes (`p` and the ghost
bounds are in bytes of the tier's capacity); the access that stores a block
(reported by `on_hit` in the request that inserted it) is the miss itself,
so only a later access moves a block from T1 to T2; T1 and T2 are queues of
LeafQueues, so a block that is not evictable is passed over.

Native twin: ArcPolicy in cpp/src/policies.cpp makes the same decisions
(`native = ...` on the class, see ucm/placement/policies/base.py); a change here must be
made there too, and tests/unit/test_placement_native.py compares the two.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from ucm.placement.heat import Key
from ucm.placement.policies.base import PlacementPolicy
from ucm.placement.policies.leafqueue import LeafQueues

T1, T2 = 0, 1


class ArcPolicy(PlacementPolicy):
    name = "arc"
    native = "arc"  # its twin in cpp/src/policies.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._c = tier.capacity_bytes
        self._p = 0.0  # target bytes of T1
        self._lists = LeafQueues(heat, 2)  # T1, T2; priority: recency order
        self._seq = 0
        self._sizes: dict[Key, int] = {}
        self._t_bytes = [0, 0]
        self._b1: OrderedDict[Key, int] = OrderedDict()
        self._b2: OrderedDict[Key, int] = OrderedDict()
        self._b_bytes = [0, 0]
        self._born: dict[Key, int] = {}  # key -> clock of its insertion

    def _place(self, key: Key, lst: int) -> None:
        self._seq += 1
        old = self._lists.queue_of(key)
        if old is not None and old != lst:
            self._t_bytes[old] -= self._sizes[key]
            self._t_bytes[lst] += self._sizes[key]
        self._lists.update(key, lst, self._seq)

    def on_insert(self, key: Key, size_bytes: int) -> None:
        bb = self._b_bytes
        if key in self._b1:
            ratio = max(1.0, bb[1] / max(1, bb[0]))
            self._p = min(float(self._c), self._p + ratio * size_bytes)
            bb[0] -= self._b1.pop(key)
            lst = T2
        elif key in self._b2:
            ratio = max(1.0, bb[0] / max(1, bb[1]))
            self._p = max(0.0, self._p - ratio * size_bytes)
            bb[1] -= self._b2.pop(key)
            lst = T2
        else:
            lst = T1
        self._seq += 1
        self._sizes[key] = size_bytes
        self._t_bytes[lst] += size_bytes
        self._lists.add(key, lst, self._seq)
        self._born[key] = self.heat.now
        self._trim_ghosts()

    def on_hit(self, key: Key) -> None:
        lst = self._lists.queue_of(key)
        if lst is None:
            return
        if lst == T1 and self._born.get(key) == self.heat.now:
            self._place(key, T1)  # the storing access itself
        else:
            self._place(key, T2)

    def on_remove(self, key: Key) -> None:
        lst = self._lists.queue_of(key)
        if lst is None:
            return
        self._lists.remove(key)
        self._born.pop(key, None)
        size = self._sizes.pop(key)
        self._t_bytes[lst] -= size
        ghost = self._b1 if lst == T1 else self._b2
        ghost[key] = size
        self._b_bytes[lst] += size
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        tb, bb, c = self._t_bytes, self._b_bytes, self._c
        while self._b1 and tb[0] + bb[0] > c:
            bb[0] -= self._b1.popitem(last=False)[1]
        while self._b2 and tb[0] + tb[1] + bb[0] + bb[1] > 2 * c:
            bb[1] -= self._b2.popitem(last=False)[1]

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        first, second = T1, T2
        if self._t_bytes[T1] == 0 or (self._t_bytes[T2] and self._t_bytes[T1] <= self._p):
            first, second = T2, T1
        for lst in (first, second):
            head = self._lists.head(lst, evictable)
            if head is not None:
                return head[1]
        return self._lists.fallback(evictable)
