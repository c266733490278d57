"""PythonPlacement: the Python reference engine of block placement.

This is the metadata half of UnifiedCache, shared with the trace replay
(`ucm bench trace`), which runs it without moving payload bytes. It
implements `PlacementEngine` (ucm/placement/base.py: the contract, its
invariants and batched calls) with any policy, third-party ones included;
the C++ core (ucm/placement/native.py) makes exactly the same decisions for
the policies with a native twin, and `make_placement`
(ucm/placement/factory.py) picks between the two.

State: the cached blocks as a prefix tree (`PrefixTree`,
ucm/placement/tree.py: parents, sizes, children in link order); which tiers
hold each block, with per tier its resident blocks, bytes and policy
(`Residency` and `TierLedger`, ucm/placement/residency.py); here, the
decisions, pins and holds.

Not thread-safe: the owner serialises calls.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.heat import HeatTracker, Key
from ucm.placement.plans import (Decision, Op, Plan, RunDecision, Step, TierCounters, TierSpec, check_next_uses,
                                check_tiers)
from ucm.placement.policies.base import Admission, PolicyFactory, TierInfo
from ucm.placement.residency import Residency, TierLedger
from ucm.placement.tree import PrefixTree

__all__ = ["PythonPlacement"]


class PythonPlacement:
    """`PlacementEngine` in Python, with any policy (module docstring)."""

    native = False  # this engine does not run on the C++ core

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        policy: PolicyFactory,
        heat: Optional[HeatTracker] = None,
        landing: int = 0,
    ) -> None:
        check_tiers(tiers, landing)
        self.heat = heat if heat is not None else HeatTracker()
        self.landing = landing
        self._tiers: list[TierLedger] = []
        for i, spec in enumerate(tiers):
            info = TierInfo(spec.name, i, spec.capacity_bytes, i == len(tiers) - 1)
            self._tiers.append(TierLedger(info, policy(info, self.heat)))
        self._tree = PrefixTree()
        self._res = Residency(self._tiers, self._tree)
        self._protect: list[Optional[Key]] = [None] * len(tiers)  # per tier, while making room
        self._pins: dict[Key, int] = {}  # promised to an engine: stays cached (some tier); counted
        self._holds: dict[Key, int] = {}  # in use where it is: stays in every tier it is in; counted
        # per tier, its victim predicates (`_build_predicates`)
        self._evictable: list[Callable[[Key], bool]] = []
        self._relaxed: list[Callable[[Key], bool]] = []
        for tier in self._tiers:
            self._build_predicates(tier)

    # ---- queries -----------------------------------------------------------
    @property
    def tier_count(self) -> int:
        return len(self._tiers)

    def tier_name(self, t: int) -> str:
        return self._tiers[t].info.name

    def capacity_bytes(self, t: int) -> int:
        return self._tiers[t].info.capacity_bytes

    def used_bytes(self, t: int) -> int:
        return self._tiers[t].used

    def blocks(self, t: int) -> int:
        return len(self._tiers[t].blocks)

    def counters(self, t: int) -> TierCounters:
        return self._tiers[t].counters

    def contains(self, key: Key) -> bool:
        return self._tree.contains(key)

    def tiers_of(self, key: Key) -> list[int]:
        return self._res.tiers_of(key)

    def where(self, key: Key) -> Optional[int]:
        """Fastest tier holding `key`, or None."""
        return self._res.where(key)

    def lookup(self, keys: Sequence[Key]) -> int:
        return self._tree.lookup(keys)

    def locate(self, keys: Sequence[Key]) -> list[Optional[int]]:
        return self._res.locate(keys)

    def size_of(self, key: Key) -> Optional[int]:
        return self._tree.size_of(key)

    def parent_of(self, key: Key) -> Optional[Key]:
        """The parent of a cached block (None for a root or an unknown key)."""
        return self._tree.parent_of(key)

    def resident_keys(self, t: int) -> Iterable[Key]:
        return self._tiers[t].blocks.keys()

    # ---- pins and holds ------------------------------------------------------
    def pin(self, keys: Iterable[Key]) -> None:
        """Counted: the blocks stay cached (in some tier) until unpinned."""
        pins = self._pins
        for k in keys:
            pins[k] = pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[Key]) -> None:
        _release(self._pins, keys)

    def hold(self, keys: Iterable[Key]) -> None:
        """Counted: the blocks stay in every tier they are in until unheld
        (their bytes are being written, staged or read there)."""
        holds = self._holds
        for k in keys:
            holds[k] = holds.get(k, 0) + 1

    def unhold(self, keys: Iterable[Key]) -> None:
        _release(self._holds, keys)

    def _stuck(self, key: Key, tier: TierLedger) -> bool:
        """Whether `key` may not leave `tier` now: held, or pinned with no
        copy in another tier."""
        if key in self._holds:
            return True
        return key in self._pins and not self._res.mask(key) & ~tier.bit

    # ---- accesses ----------------------------------------------------------
    def record_request(self, keys: Sequence[Key], next_uses: Optional[Sequence[float]] = None,
                       parent: Optional[Key] = None) -> None:
        """Counts one access to each block of a request in the HeatTracker
        (call once per request before lookups and inserts); deepest first.
        `parent`: the block before keys[0] (a store that continues a cached
        prefix), so the tracker knows what keys[0] follows. `next_uses`
        (trace replay): one number per key, not NaN, else ArgumentError
        before anything is recorded."""
        check_next_uses(keys, next_uses)
        heat = self.heat
        heat.tick()
        heat.touch_request(keys, parent, next_uses)

    def finish_request(self, keys: Sequence[Key], output_tokens: int) -> None:
        """The request that used `keys` finished after generating
        `output_tokens` tokens: tells the HeatTracker, then, for each block
        whose kind changed, the policy of every tier holding it
        (`on_reclass`)."""
        mask = self._res.mask
        for k in self.heat.finish(keys, output_tokens):
            m = mask(k)
            for tier in self._tiers:
                if m & tier.bit:
                    tier.policy.on_reclass(k)

    def touch(self, keys: Sequence[Key]) -> None:
        """Reports that the resident blocks among `keys` were used by a request:
        one `on_hit` to the tier serving each, deepest block first."""
        where, tiers = self._res.where, self._tiers
        for k in reversed(keys):
            t = where(k)
            if t is not None:
                tier = tiers[t]
                tier.policy.on_hit(k)
                tier.counters.hits += 1

    # ---- changes -----------------------------------------------------------
    def insert(self, key: Key, parent: Optional[Key], size_bytes: int,
               tier: Optional[int] = None, restored: bool = False) -> Decision:
        """Places a new block (bytes from the caller) into `tier` (default the
        landing tier); the plan then ends in a WRITE step. Not placed when the
        block is already resident (empty plan), its parent is not resident,
        the policy refused it, or no room could be made. `restored` records a
        block found in the tier at start-up: no admission, no WRITE step."""
        if size_bytes <= 0:
            raise ArgumentError(f"size_bytes must be > 0, got {size_bytes}")
        plan: Plan = []
        placed = self._insert(key, parent, size_bytes, self.landing if tier is None else tier, restored, plan)
        return Decision(placed, plan)

    def insert_run(self, keys: Sequence[Key], parent: Optional[Key], sizes: Sequence[int],
                   tier: Optional[int] = None) -> RunDecision:
        """Stores consecutive blocks of one prompt: `keys[0]` behind `parent`,
        each later key behind the one before it, with `sizes[i]` bytes each,
        into `tier` (default the landing tier). The same decisions as
        `insert(keys[i], keys[i - 1], sizes[i])` for each key in order,
        skipping keys already cached, stopping at the first key that is
        neither placed nor cached (its descendants would be useless); one
        plan for the run, each placed block's WRITE step after the steps
        that made its room."""
        n = len(keys)
        if len(sizes) != n:
            raise ArgumentError(f"insert_run: {n} keys but {len(sizes)} sizes")
        for size in sizes:
            if size <= 0:
                raise ArgumentError(f"size_bytes must be > 0, got {size}")
        t = self.landing if tier is None else tier
        plan: Plan = []
        placed = [False] * n
        cached = self._tree.contains
        ins = self._insert
        stop = n
        for i in range(n):
            key = keys[i]
            if ins(key, parent, sizes[i], t, False, plan):
                placed[i] = True
            elif not cached(key):
                stop = i
                break
            parent = key
        return RunDecision(placed, plan, stop)

    def _insert(self, key: Key, parent: Optional[Key], size_bytes: int, t: int, restored: bool,
                plan: Plan) -> bool:
        cached = self._tree.contains
        if cached(key):
            return False
        if parent is not None and not cached(parent):
            return False
        dst = self._tiers[t]
        if size_bytes > dst.info.capacity_bytes or not (restored or dst.policy.admit(key, Admission.NEW)):
            return False
        if dst.used + size_bytes > dst.info.capacity_bytes and not self._make_room(t, size_bytes, plan, parent):
            return False
        if parent is not None and not cached(parent):  # lost while making room
            return False
        self._tree.link(key, parent, size_bytes)
        self._res.enter(key, t, size_bytes)
        if not restored:  # a restored block's bytes are already in the tier
            plan.append(Step(Op.WRITE, key, None, t))
        return True

    def promote(self, key: Key, force: bool = False) -> Decision:
        """After a hit served below the landing tier: copies the block up if
        the landing tier's policy admits it (COPY step; the lower copy stays).
        `force` skips admission: the block must be staged (a reader needs it
        in the landing tier's shared memory). A placed promotion tells the
        source tier's policy (`on_copied_up`: lru counts it as a use of the
        copy that stays, which else keeps the recency of its first demotion
        while the block is reused through the landing tier)."""
        src = self.where(key)
        t = self.landing
        if src is None or src <= t:
            return Decision(False, [])
        dst = self._tiers[t]
        size = self._tree.size_of(key)
        if not (force or dst.policy.admit(key, Admission.PROMOTE)):
            return Decision(False, [])
        plan: Plan = []
        self._holds[key] = self._holds.get(key, 0) + 1  # the source must survive the evictions made for it
        try:
            room = self._make_room(t, size, plan, protect=self._tree.parent_of(key))
        finally:
            self.unhold([key])
        if not room or not self._tree.contains(key):
            return Decision(False, plan)
        self._tiers[src].policy.on_copied_up(key)
        self._res.enter(key, t, size)
        dst.counters.promotions_in += 1
        plan.append(Step(Op.COPY, key, src=src, dst=t))
        return Decision(True, plan)

    def reclaim(self, t: int, free_bytes: int, max_victims: int) -> Plan:
        """Evicts up to `max_victims` of tier t's victims (demoted as on any
        eviction) while less than `free_bytes` of it is free: room made
        ahead of need. The plan is empty when there is room already."""
        tier = self._tiers[t]
        cap = tier.info.capacity_bytes
        plan: Plan = []
        if tier.info.lowest:
            return plan
        for _ in range(max_victims):
            if tier.used + free_bytes <= cap:
                break
            before = tier.used  # room for one byte more than is free: exactly one victim
            if not self._make_room(t, cap - before + 1, plan, None) or tier.used >= before:
                break
        return plan

    def may_evict(self, t: int, keys: Iterable[Key], protect: Optional[Key] = None,
                  relaxed: bool = False) -> bool:
        """Whether `evict_keys(t, keys)` would evict every one of `keys`: each
        is resident in tier t, not pinned and not `protect`; a child of one
        that is resident in t is one of them too (children go first), unless
        `relaxed` in a tier that is not the lowest (a parent is demoted ahead
        of its children, as when only parents are left); and in the lowest
        tier a block held nowhere else leaves only with every child it has,
        which must be held nowhere else either (a parent never leaves the
        cache while a child is cached)."""
        group = keys if isinstance(keys, (set, frozenset, dict)) else dict.fromkeys(keys)
        tier = self._tiers[t]
        if not group:
            return False
        for k in group:
            if k not in tier.blocks or self._stuck(k, tier) or k == protect:
                return False
        lowest = tier.info.lowest
        if relaxed and not lowest:
            return True
        for k in group:
            kids = self._tree.children_of(k)
            if not lowest or any(k in o.blocks for o in self._tiers if o is not tier):
                if tier.kids.get(k) and any(c in tier.blocks and c not in group for c in kids):
                    return False
            elif any(c not in group or len(self.tiers_of(c)) > 1 for c in kids):
                return False
        return True

    def evict_keys(self, t: int, keys: Iterable[Key], any_one: bool = False,
                   protect: Optional[Key] = None, relaxed: bool = False) -> Plan:
        """Evicts from tier t blocks an adapter names because it needs those
        very blocks gone (the DRAM arena emptying an extent for another size
        class: `DramAdapter.victims_for`), demoted or dropped exactly as any
        eviction. `any_one`: only the policy's victim among `keys` (its
        evictable blocks; `relaxed` also its parents, outside the lowest
        tier). Otherwise all of them, children before parents, or none when
        `may_evict` says no. `protect` (the parent of the block that needs
        the room) never goes. The plan is empty when nothing was evicted."""
        tier = self._tiers[t]
        plan: Plan = []
        if any_one:
            named = {k for k in keys if k in tier.blocks}
            if not named:
                return plan
            evictable = self._evictable_in(t, protect)
            victim = tier.policy.victim(lambda k: k in named and evictable(k))
            if victim is None and relaxed and not tier.info.lowest:
                victim = tier.policy.victim(lambda k: k in named and not self._stuck(k, tier) and k != protect)
            if victim is not None:
                self._evict(victim, t, plan)
            return plan
        group = dict.fromkeys(keys)  # an ordered set: evictions in the caller's order
        if not self.may_evict(t, group, protect=protect, relaxed=relaxed):
            return plan
        for k in self._tree.children_first(group):
            if k in tier.blocks:  # not dropped meanwhile with a parent whose demotion failed
                self._evict(k, t, plan)
        return plan

    def remove(self, key: Key, tier: Optional[int] = None) -> Plan:
        """A tier lost `key` (failed write, corrupt bytes, adapter eviction,
        explicit delete); with tier None every copy is gone. If no copy is
        left, its resident descendants are useless and are dropped too: the
        returned DROP steps name them (the caller deletes their bytes)."""
        if not self._tree.contains(key):
            return []
        tiers = self.tiers_of(key) if tier is None else [tier]
        for t in tiers:
            if key in self._tiers[t].blocks:
                self._res.leave(key, t)
        plan: Plan = []
        if not self.tiers_of(key):
            self._drop_descendants(key, plan)
        return plan

    def watch(self, on_link: Callable[[Key], None], on_unlink: Callable[[Key], None]) -> None:
        """Calls on_link(key) for every cached key now and whenever one
        enters the cache, on_unlink(key) when one leaves it (what `lookup`
        and `contains` answer), synchronously under the owner's lock."""
        self._tree.watch(on_link, on_unlink)

    # ---- internals ---------------------------------------------------------
    def _build_predicates(self, tier: TierLedger) -> None:
        """The tier's victim predicates, built once: `evictable` (what a
        policy may offer) and `relaxed` (any block that may leave the tier,
        when only parents are left). Both read the block to protect from
        `_protect[t]`, set while room is made."""
        t = tier.info.index
        holds, pins, mask, protect = self._holds, self._pins, self._res.mask, self._protect
        kids = tier.kids
        others = ~tier.bit

        def relaxed(key: Key) -> bool:
            return key != protect[t] and key not in holds and (key not in pins or mask(key) & others != 0)

        if not tier.info.lowest:
            def evictable(key: Key) -> bool:
                return (key != protect[t] and key not in kids and key not in holds
                        and (key not in pins or mask(key) & others != 0))
        else:
            has_children = self._tree.has_children

            def evictable(key: Key) -> bool:
                # From the lowest tier a block leaves the cache unless another tier
                # holds it; then its children anywhere would be orphaned.
                if key == protect[t] or key in kids or key in holds:
                    return False
                elsewhere = mask(key) & others
                if key in pins and not elsewhere:
                    return False
                return elsewhere != 0 or not has_children(key)

        self._evictable.append(evictable)
        self._relaxed.append(relaxed)

    def _evictable_in(self, t: int, protect: Optional[Key]) -> Callable[[Key], bool]:
        """Tier t's `evictable` predicate with `protect` as the block to keep
        (for a victim search outside `_make_room`)."""
        evictable, prot = self._evictable[t], self._protect

        def check(key: Key) -> bool:
            saved = prot[t]
            prot[t] = protect
            try:
                return evictable(key)
            finally:
                prot[t] = saved

        return check

    def _make_room(self, t: int, size: int, plan: Plan, protect: Optional[Key]) -> bool:
        tier = self._tiers[t]
        cap = tier.info.capacity_bytes
        if size > cap:
            return False
        if tier.used + size <= cap:
            return True
        prot = self._protect
        saved = prot[t]
        prot[t] = protect
        try:
            policy = tier.policy
            evictable, relaxed = self._evictable[t], self._relaxed[t]
            lowest = tier.info.lowest
            while tier.used + size > cap:
                victim = policy.victim(evictable)
                if victim is None and not lowest:
                    # Only parents are left: demote one ahead of its children (it
                    # stays cached below, so the prefix survives).
                    victim = policy.victim(relaxed)
                if victim is None:
                    return False
                self._evict(victim, t, plan)
            return True
        finally:
            prot[t] = saved

    def _evict(self, key: Key, t: int, plan: Plan) -> None:
        tiers = self._tiers
        tier = tiers[t]
        tier.counters.evictions += 1
        size = tier.blocks[key]
        elsewhere = self._res.mask(key) & ~tier.bit
        lower = t + 1
        if lower < len(tiers) and not elsewhere:
            below = tiers[lower]
            needed = self._tree.has_children(key)  # has resident children: keep the prefix
            if needed or below.policy.admit(key, Admission.DEMOTE):
                self._res.leave(key, t)
                holds = self._holds
                holds[key] = holds.get(key, 0) + 1
                try:
                    room = self._make_room(lower, size, plan, self._tree.parent_of(key))
                finally:
                    n = holds[key]
                    if n <= 1:
                        del holds[key]
                    else:
                        holds[key] = n - 1
                if room and self._tree.contains(key):
                    self._res.enter(key, lower, size)
                    below.counters.demotions_in += 1
                    plan.append(Step(Op.MOVE, key, t, lower))
                    return
                plan.append(Step(Op.DROP, key, t))
                if self._tree.contains(key):  # else lost while making room: an ancestor left the cache
                    self._drop_descendants(key, plan)
                return
        self._res.leave(key, t)
        plan.append(Step(Op.DROP, key, t))
        if not elsewhere:
            self._drop_descendants(key, plan)

    def _drop_descendants(self, key: Key, plan: Plan) -> None:
        """`key` left its last tier: drop its resident descendants (useless
        without it) and forget the whole subtree."""
        tree, res = self._tree, self._res
        for k in tree.subtree(key):  # deepest first
            for x in res.tiers_of(k):
                res.leave(k, x)
                plan.append(Step(Op.DROP, k, x))
            tree.unlink(k)


def _release(counts: dict[Key, int], keys: Iterable[Key]) -> None:
    for k in keys:
        n = counts.get(k, 0)
        if n <= 1:
            counts.pop(k, None)
        else:
            counts[k] = n - 1
