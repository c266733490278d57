"""OPT: Belady's offline optimum, the upper bound of the trace benchmark.

Needs the oracle: the trace replay tells the HeatTracker, for every block of
a request, the clock of its next access (`record_request(keys, next_uses)`);
outside a replay every next use is unknown (infinite) and OPT degenerates to
evicting the newest block.

- Eviction: the evictable block whose next use is farthest; among equal next
  uses (blocks of one future request, or never used again) the most recently
  inserted goes first. Under prefix semantics a child's next use is never
  earlier than its parent's, and a child is inserted after its parent, so
  this order always reaches a leaf before its ancestors.
- Admission (Belady with bypass): a block enters a full tier only if its next
  use is nearer than that of every block resident there; otherwise storing
  it could only cost a hit. The landing tier of a multi-tier stack admits
  every new block (a refusal there would lose it from all tiers; its victims
  are demoted under the same rule below).

Next uses are kept exact without being told about every access: a block's
next use changes only when it is accessed, which is exactly when its recorded
next use falls due. A second heap ordered by due time finds those entries
and refreshes them from the HeatTracker before each decision, so a copy in a
tier that did not serve the access is refreshed too. Everything is
O(log n) per event.

Native twin: `opt` in the C++ placement core (cpp/src/policy_opt.cpp), the
same two heaps with the same lazy invalidation and rebuilds, reading the
next uses from the core's HeatMirror (filled by the same `record_request`);
`Placement` runs it there, so a trace replay with a fresh HeatTracker
replays OPT natively. tests/unit/test_placement_native.py compares its
every plan with this class, with the oracle's next uses and with wrong ones.
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

from ucm.placement.heat import INF, Key
from ucm.placement.policies.base import Admission, PlacementPolicy


class OptPolicy(PlacementPolicy):
    name = "opt"
    live = False  # needs each block's next use: trace replay only
    native = "opt"  # cpp/src/policy_opt.cpp

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._seq = 0
        self._born: dict[Key, int] = {}  # resident key -> insertion sequence
        self._next: dict[Key, float] = {}  # resident key -> next use as pushed
        self._far: list[tuple[float, int, Key]] = []  # (-next use, -seq, key): farthest first
        self._due: list[tuple[float, int, Key]] = []  # (next use, seq, key): soonest first
        self._sizes: dict[Key, int] = {}
        self._used = 0
        self._block = 0  # bytes of the last block stored; admission estimates room with it

    def _push(self, key: Key, nu: float) -> None:
        seq = self._born[key]
        self._next[key] = nu
        heapq.heappush(self._far, (-nu, -seq, key))
        if nu != INF:
            heapq.heappush(self._due, (nu, seq, key))
        if len(self._far) > 4 * len(self._born) + 64:
            self._far = [(-v, -self._born[k], k) for k, v in self._next.items()]
            heapq.heapify(self._far)
            self._due = [(v, self._born[k], k) for k, v in self._next.items() if v != INF]
            heapq.heapify(self._due)

    def _sync(self) -> None:
        """Refreshes every resident block whose recorded next use is past."""
        now = self.heat.now
        due = self._due
        while due and due[0][0] <= now:
            nu, seq, key = heapq.heappop(due)
            if self._born.get(key) != seq or self._next.get(key) != nu:
                continue  # stale entry
            fresh = self.heat.next_use(key)
            if fresh != nu:
                self._push(key, fresh)

    def _valid(self, item: tuple[float, int, Key]) -> bool:
        neg_nu, neg_seq, key = item
        return self._born.get(key) == -neg_seq and self._next.get(key) == -neg_nu

    def _farthest(self) -> float:
        """Next use of the resident block used farthest in the future."""
        self._sync()
        far = self._far
        while far and not self._valid(far[0]):
            heapq.heappop(far)
        return -far[0][0] if far else -INF

    def admit(self, key: Key, why: Admission) -> bool:
        if why is Admission.NEW and not self.tier.lowest:
            return True
        if not self._born or self._used + self._block <= self.tier.capacity_bytes:
            return True
        return self.heat.next_use(key) < self._farthest()

    def on_insert(self, key: Key, size_bytes: int) -> None:
        self._seq += 1
        self._born[key] = self._seq
        self._sizes[key] = size_bytes
        self._used += size_bytes
        self._block = size_bytes
        self._push(key, self.heat.next_use(key))

    def on_hit(self, key: Key) -> None:
        if key in self._born:
            nu = self.heat.next_use(key)
            if nu != self._next[key]:
                self._push(key, nu)

    def on_remove(self, key: Key) -> None:
        if self._born.pop(key, None) is not None:
            self._next.pop(key)
            self._used -= self._sizes.pop(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        self._sync()
        far = self._far
        skipped: list[tuple[float, int, Key]] = []
        found: Optional[Key] = None
        while far:
            item = heapq.heappop(far)
            if not self._valid(item):
                continue
            if evictable(item[2]):
                found = item[2]
                heapq.heappush(far, item)  # stays valid until on_remove
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(far, item)
        return found
