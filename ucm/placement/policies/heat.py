"""The heat policy: evict, admit and promote by learned hit density.

Built from what KV-cache workloads look like, not from constants fitted to a
trace:
- most blocks are used once, and a block that came back tends to come back
  again; a shared prefix is used by many requests; a conversation's next
  turn rewrites the last, partly filled block of its prompt; new text behind
  a known prefix (a question after a template) fares otherwise than text
  that came with a new prefix; the job a prompt serves shows in how long an
  answer it got (short answers over documents queried again, long one-shot
  summaries). So blocks fall in sixteen classes: used once (behind an
  unseen or a seen prefix), twice, or three times or more; whether their
  last access ended a request; and whether their last finished request
  generated a long answer (ucm/placement/policies/reuse.py);
- reuse comes in bursts across the turns of a conversation, and how soon
  depends on the workload. The ReuseModel learns each class's reuse hazard
  at each age (ticks since the last access) from every access the
  HeatTracker sees, misses included: the tracker's long history acts as a
  ghost list, so what it learns does not depend on what was kept;
- shared prefixes are hot: they are reused, and recent;
- a child is useless without its parent: only leaves are offered as
  victims (LeafQueues parks parents), and a child never ranks above its
  parent (it is never reused more often, nor more recently).

A block's value is its hit density (Beckmann et al., LHD, NSDI 2018): the
chance it is reused within the tier's horizon over the time it occupies the
tier meanwhile, from a table per (class, age bucket) refreshed every tick.
The horizon is the tier's mean residence time (Little's law: resident
blocks over blocks stored per tick), so a small DRAM tier values near reuse
and a large NVMe tier far reuse.

- Eviction: the lowest value among the oldest evictable block of each class
  (hazards fall with age within a class; the table decides across classes).
  A block accessed through another tier (a copy in NVMe while DRAM serves)
  is re-queued when it reaches the head, so the order follows true recency.
- Admission into a full tier: a new block into the lowest tier, a demotion
  into a tier below, a promotion into a tier above, only if its value is at
  least that of the block it would displace. So blocks that would be the
  next to go cost no NVMe write, and a one-shot block is not stored at all
  when the tier is full of better ones. A new block entering a landing tier
  that has tiers below is always admitted (refused there, it would be lost
  everywhere; its demotion is judged below).
- Promotion: a hit served below is copied up under the same rule.

Native twin: HeatPolicy in cpp/src/policy_heat.cpp (`native = "heat"`,
see ucm/placement/policies/base.py) makes exactly these decisions with the native
ReuseModel; a change here must be made there too, and
tests/unit/test_placement_native.py compares the two.
"""
from __future__ import annotations

from typing import Callable, Optional

from ucm.placement.heat import Key
from ucm.placement.policies.base import Admission, PlacementPolicy
from ucm.placement.policies.leafqueue import LeafQueues
from ucm.placement.policies.reuse import AGE_BUCKETS, NUM_CLASSES, ReuseModel, class_of


def _always(key: Key) -> bool:
    return True


class HeatPolicy(PlacementPolicy):
    name = "heat"
    native = "heat"

    def __init__(self, tier, heat, **options) -> None:
        super().__init__(tier, heat, **options)
        self._model = ReuseModel.of(heat)
        # One queue per class; priority (clock of the last access as queued,
        # order of the report) so the head of a class is its oldest block.
        self._queues = LeafQueues(heat, NUM_CLASSES)
        self._seq = 0
        self._sizes: dict[Key, int] = {}
        self._used = 0
        self._block = 0  # bytes of the last block stored; admission estimates room with it
        self._inserts = 0  # blocks stored since the first one
        self._first_tick = -1
        self._table: Optional[list[list[float]]] = None
        self._table_version = -1

    # ---- values ------------------------------------------------------------
    def _densities(self) -> list[list[float]]:
        m = self._model
        if self._table is None or m.version != self._table_version:  # once a tick
            self._table = m.density(self._residence())
            self._table_version = m.version
        return self._table

    def _residence(self) -> float:
        """Mean ticks a block stays in this tier (Little's law: resident
        blocks over blocks stored per tick): the horizon of its values."""
        if self._inserts == 0:
            return 1.0
        ticks = self.heat.now - self._first_tick + 1
        return max(1.0, len(self._sizes) * ticks / self._inserts)

    def _value(self, key: Key, table: list[list[float]]) -> float:
        heat = self.heat
        s = heat.slot(key)
        if s is None:
            return 0.0
        age = heat.now - heat.last[s]
        return table[class_of(heat, s)][min(age.bit_length() - 1, AGE_BUCKETS - 1) if age > 1 else 0]

    def _requeue(self, key: Key) -> None:
        heat = self.heat
        s = heat.slot(key)
        self._seq += 1
        if s is None:
            self._queues.update(key, 0, (-1, self._seq))
        else:
            self._queues.update(key, class_of(heat, s), (heat.last[s], self._seq))

    def _lowest(self, evictable: Callable[[Key], bool]) -> Optional[tuple[float, tuple, Key]]:
        """The evictable block of lowest value among the oldest of each class."""
        table = self._densities()
        best: Optional[tuple[float, tuple, Key]] = None
        queues = self._queues
        heat = self.heat
        for q in queues.nonempty():
            while True:
                head = queues.head(q, evictable)
                if head is None:
                    break
                prio, key = head
                s = heat.slot(key)
                if s is not None and (heat.last[s] != prio[0] or class_of(heat, s) != q):
                    # Accessed since it was queued, served by another tier
                    # (or the class moved): put it where it belongs, look again.
                    self._requeue(key)
                    continue
                v = self._value(key, table)
                if best is None or (v, prio) < best[:2]:
                    best = (v, prio, key)
                break
        return best

    # ---- policy interface ----------------------------------------------------
    def admit(self, key: Key, why: Admission) -> bool:
        if not self._sizes or self._used + self._block <= self.tier.capacity_bytes:
            return True
        if why is Admission.NEW and not self.tier.lowest:
            return True
        low = self._lowest(_always)
        if low is None:
            return True
        return self._value(key, self._densities()) >= low[0]

    def on_insert(self, key: Key, size_bytes: int) -> None:
        if key in self._queues:
            self.on_remove(key)
        self._seq += 1
        heat = self.heat
        s = heat.slot(key)
        if s is None:
            self._queues.add(key, 0, (-1, self._seq))
        else:
            self._queues.add(key, class_of(heat, s), (heat.last[s], self._seq))
        self._sizes[key] = size_bytes
        self._used += size_bytes
        self._block = size_bytes
        self._inserts += 1
        if self._first_tick < 0:
            self._first_tick = self.heat.now

    def on_hit(self, key: Key) -> None:
        if key in self._queues:
            self._requeue(key)

    def on_reclass(self, key: Key) -> None:
        if key in self._queues:
            self._requeue(key)

    def on_remove(self, key: Key) -> None:
        self._queues.remove(key)
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size

    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]:
        low = self._lowest(evictable)
        if low is None:
            return self._queues.fallback(evictable)
        return low[2]
