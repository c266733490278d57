"""PythonPlacement: the Python reference engine of block placement.

This is the metadata half of UnifiedCache, shared with the trace replay
(`ucm bench trace`), which runs it without moving payload bytes. It
implements `PlacementEngine` (ucm/placement/base.py: the contract, its
invariants and batched calls) with any policy, third-party ones included;
the C++ core (ucm/placement/native.py) makes exactly the same decisions for
the policies with a native twin, and `make_placement`
(ucm/placement/factory.py) picks between the two.

State: per tier, the resident blocks with their sizes, the count of
resident children per parent and the policy instance; across tiers, a bit
mask of the tiers holding each key, the prefix tree (parent per key and
resident children in link order), sizes, pins and holds.

Not thread-safe: the owner serialises calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.heat import HeatTracker, Key
from ucm.placement.plans import (Decision, Op, Plan, RunDecision, Step, TierCounters, TierSpec, check_next_uses,
                                check_tiers)
from ucm.placement.policies.base import Admission, PlacementPolicy, PolicyFactory, TierInfo

__all__ = ["PythonPlacement"]


@dataclass(slots=True)
class _Tier:
    info: TierInfo
    policy: PlacementPolicy
    used: int = 0
    blocks: dict[Key, int] = field(default_factory=dict)  # key -> size_bytes
    kids: dict[Key, int] = field(default_factory=dict)  # key -> resident children in this tier (> 0)
    counters: TierCounters = field(default_factory=TierCounters)
    bit: int = 0  # 1 << index, its bit in PythonPlacement._res
    evictable: Optional[Callable[[Key], bool]] = None  # victim predicates, built once
    relaxed: Optional[Callable[[Key], bool]] = None


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
        self._tiers: list[_Tier] = []
        for i, spec in enumerate(tiers):
            info = TierInfo(spec.name, i, spec.capacity_bytes, i == len(tiers) - 1)
            self._tiers.append(_Tier(info, policy(info, self.heat), bit=1 << i))
        self._res: dict[Key, int] = {}  # resident key -> bit mask of the tiers holding it
        self._protect: list[Optional[Key]] = [None] * len(tiers)  # per tier, while making room
        self._parent: dict[Key, Optional[Key]] = {}  # resident anywhere -> parent
        # resident parent -> resident children, in the order they were linked
        # (a dict as an ordered set: drops and evictions walk them in that order)
        self._children: dict[Key, dict[Key, None]] = {}
        self._size: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}  # promised to an engine: stays cached (some tier); counted
        self._holds: dict[Key, int] = {}  # in use where it is: stays in every tier it is in; counted
        self._on_link: Optional[Callable[[Key], None]] = None
        self._on_unlink: Optional[Callable[[Key], None]] = None
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
        return key in self._parent

    def tiers_of(self, key: Key) -> list[int]:
        m = self._res.get(key, 0)
        return [t for t in range(len(self._tiers)) if m >> t & 1]

    def where(self, key: Key) -> Optional[int]:
        """Fastest tier holding `key`, or None."""
        m = self._res.get(key)
        if not m:
            return None
        return (m & -m).bit_length() - 1

    def lookup(self, keys: Sequence[Key]) -> int:
        n = 0
        for k in keys:
            if k not in self._parent:
                break
            n += 1
        return n

    def locate(self, keys: Sequence[Key]) -> list[Optional[int]]:
        res = self._res
        out: list[Optional[int]] = []
        for k in keys:
            m = res.get(k)
            out.append((m & -m).bit_length() - 1 if m else None)
        return out

    def size_of(self, key: Key) -> Optional[int]:
        return self._size.get(key)

    def parent_of(self, key: Key) -> Optional[Key]:
        """The parent of a cached block (None for a root or an unknown key)."""
        return self._parent.get(key)

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

    def _stuck(self, key: Key, tier: "_Tier") -> bool:
        """Whether `key` may not leave `tier` now: held, or pinned with no
        copy in another tier."""
        if key in self._holds:
            return True
        return key in self._pins and not self._res.get(key, 0) & ~tier.bit

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
        res = self._res
        for k in self.heat.finish(keys, output_tokens):
            m = res.get(k, 0)
            for tier in self._tiers:
                if m & tier.bit:
                    tier.policy.on_reclass(k)

    def touch(self, keys: Sequence[Key]) -> None:
        """Reports that the resident blocks among `keys` were used by a request:
        one `on_hit` to the tier serving each, deepest block first."""
        res, tiers = self._res, self._tiers
        for k in reversed(keys):
            m = res.get(k)
            if m:
                tier = tiers[(m & -m).bit_length() - 1]
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
        cached = self._parent
        ins = self._insert
        stop = n
        for i in range(n):
            key = keys[i]
            if ins(key, parent, sizes[i], t, False, plan):
                placed[i] = True
            elif key not in cached:
                stop = i
                break
            parent = key
        return RunDecision(placed, plan, stop)

    def _insert(self, key: Key, parent: Optional[Key], size_bytes: int, t: int, restored: bool,
                plan: Plan) -> bool:
        cached = self._parent
        if key in cached:
            return False
        if parent is not None and parent not in cached:
            return False
        dst = self._tiers[t]
        if size_bytes > dst.info.capacity_bytes or not (restored or dst.policy.admit(key, Admission.NEW)):
            return False
        if dst.used + size_bytes > dst.info.capacity_bytes and not self._make_room(t, size_bytes, plan, parent):
            return False
        if parent is not None and parent not in cached:  # lost while making room
            return False
        self._link(key, parent, size_bytes)
        self._enter(key, t, size_bytes)
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
        size = self._size[key]
        if not (force or dst.policy.admit(key, Admission.PROMOTE)):
            return Decision(False, [])
        plan: Plan = []
        self._holds[key] = self._holds.get(key, 0) + 1  # the source must survive the evictions made for it
        try:
            room = self._make_room(t, size, plan, protect=self._parent.get(key))
        finally:
            self.unhold([key])
        if not room or key not in self._parent:
            return Decision(False, plan)
        self._tiers[src].policy.on_copied_up(key)
        self._enter(key, t, size)
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
            kids = self._children.get(k, ())
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
        for k in self._children_first(group):
            if k in tier.blocks:  # not dropped meanwhile with a parent whose demotion failed
                self._evict(k, t, plan)
        return plan

    def remove(self, key: Key, tier: Optional[int] = None) -> Plan:
        """A tier lost `key` (failed write, corrupt bytes, adapter eviction,
        explicit delete); with tier None every copy is gone. If no copy is
        left, its resident descendants are useless and are dropped too: the
        returned DROP steps name them (the caller deletes their bytes)."""
        if key not in self._parent:
            return []
        tiers = self.tiers_of(key) if tier is None else [tier]
        for t in tiers:
            if key in self._tiers[t].blocks:
                self._leave(key, t)
        plan: Plan = []
        if not self.tiers_of(key):
            self._drop_descendants(key, plan)
        return plan

    # ---- internals ---------------------------------------------------------
    def watch(self, on_link: Callable[[Key], None], on_unlink: Callable[[Key], None]) -> None:
        """Calls on_link(key) for every cached key now and whenever one
        enters the cache, on_unlink(key) when one leaves it (what `lookup`
        and `contains` answer), synchronously under the owner's lock."""
        for key in self._parent:
            on_link(key)
        self._on_link, self._on_unlink = on_link, on_unlink

    def _link(self, key: Key, parent: Optional[Key], size: int) -> None:
        if self._on_link is not None and key not in self._parent:
            self._on_link(key)
        self._parent[key] = parent
        self._size[key] = size
        if parent is not None:
            kids = self._children.get(parent)
            if kids is None:
                self._children[parent] = {key: None}
            else:
                kids[key] = None

    def _unlink(self, key: Key) -> None:
        parent = self._parent.pop(key)
        if self._on_unlink is not None:
            self._on_unlink(key)
        self._size.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.pop(key, None)
                if not kids:
                    del self._children[parent]

    def _enter(self, key: Key, t: int, size: int) -> None:
        tier = self._tiers[t]
        blocks = tier.blocks
        blocks[key] = size
        tier.used += size
        c = tier.counters
        c.inserts += 1
        c.bytes_written += size
        res = self._res
        res[key] = res.get(key, 0) | tier.bit
        kids = self._children.get(key)
        if kids:
            n = sum(1 for k in kids if k in blocks)
            if n:
                tier.kids[key] = n
        parent = self._parent.get(key)
        if parent is not None and parent in blocks:
            tier.kids[parent] = tier.kids.get(parent, 0) + 1
        tier.policy.on_insert(key, size)

    def _leave(self, key: Key, t: int) -> None:
        tier = self._tiers[t]
        blocks = tier.blocks
        tier.used -= blocks.pop(key)
        res = self._res
        m = res[key] & ~tier.bit
        if m:
            res[key] = m
        else:
            del res[key]
        kids = tier.kids
        kids.pop(key, None)
        parent = self._parent.get(key)
        if parent is not None and parent in blocks:
            left = kids[parent] - 1
            if left > 0:
                kids[parent] = left
            else:
                del kids[parent]
        tier.policy.on_remove(key)

    def _build_predicates(self, tier: "_Tier") -> None:
        """The tier's victim predicates, built once: `evictable` (what a
        policy may offer) and `relaxed` (any block that may leave the tier,
        when only parents are left). Both read the block to protect from
        `_protect[t]`, set while room is made."""
        t = tier.info.index
        holds, pins, res, protect = self._holds, self._pins, self._res, self._protect
        kids = tier.kids
        others = ~tier.bit

        def relaxed(key: Key) -> bool:
            return key != protect[t] and key not in holds and (key not in pins or res.get(key, 0) & others != 0)

        if not tier.info.lowest:
            def evictable(key: Key) -> bool:
                return (key != protect[t] and key not in kids and key not in holds
                        and (key not in pins or res.get(key, 0) & others != 0))
        else:
            children = self._children

            def evictable(key: Key) -> bool:
                # From the lowest tier a block leaves the cache unless another tier
                # holds it; then its children anywhere would be orphaned.
                if key == protect[t] or key in kids or key in holds:
                    return False
                elsewhere = res.get(key, 0) & others
                if key in pins and not elsewhere:
                    return False
                return key not in children or elsewhere != 0

        tier.evictable, tier.relaxed = evictable, relaxed

    def _evictable_in(self, t: int, protect: Optional[Key]) -> Callable[[Key], bool]:
        """Tier t's `evictable` predicate with `protect` as the block to keep
        (for a victim search outside `_make_room`)."""
        tier = self._tiers[t]
        evictable, prot = tier.evictable, self._protect

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
            evictable, relaxed = tier.evictable, tier.relaxed
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
        elsewhere = self._res[key] & ~tier.bit
        lower = t + 1
        if lower < len(tiers) and not elsewhere:
            below = tiers[lower]
            needed = key in self._children  # has resident children: keep the prefix
            if needed or below.policy.admit(key, Admission.DEMOTE):
                self._leave(key, t)
                holds = self._holds
                holds[key] = holds.get(key, 0) + 1
                try:
                    room = self._make_room(lower, size, plan, self._parent.get(key))
                finally:
                    n = holds[key]
                    if n <= 1:
                        del holds[key]
                    else:
                        holds[key] = n - 1
                if room and key in self._parent:
                    self._enter(key, lower, size)
                    below.counters.demotions_in += 1
                    plan.append(Step(Op.MOVE, key, t, lower))
                    return
                plan.append(Step(Op.DROP, key, t))
                if key in self._parent:  # else lost while making room: an ancestor left the cache
                    self._drop_descendants(key, plan)
                return
        self._leave(key, t)
        plan.append(Step(Op.DROP, key, t))
        if not elsewhere:
            self._drop_descendants(key, plan)

    def _children_first(self, group: dict[Key, None]) -> list[Key]:
        """The keys of `group` ordered so that each comes after every one of
        its descendants in the group."""
        order: list[Key] = []
        stack = [(k, False) for k in group if self._parent.get(k) not in group]
        while stack:
            k, expanded = stack.pop()
            if expanded:
                order.append(k)
                continue
            stack.append((k, True))
            stack.extend((c, False) for c in self._children.get(k, ()) if c in group)
        return order

    def _drop_descendants(self, key: Key, plan: Plan) -> None:
        """`key` left its last tier: drop its resident descendants (useless
        without it) and forget the whole subtree."""
        children, res = self._children, self._res
        if key not in children:  # a leaf: the common case
            m = res.get(key, 0)
            x = 0
            while m:
                if m & 1:
                    self._leave(key, x)
                    plan.append(Step(Op.DROP, key, x))
                m >>= 1
                x += 1
            self._unlink(key)
            return
        stack = [key]
        order: list[Key] = []
        while stack:
            k = stack.pop()
            order.append(k)
            kids = children.get(k)
            if kids:
                stack.extend(kids)
        for k in reversed(order):  # deepest first
            for x in self.tiers_of(k):
                self._leave(k, x)
                plan.append(Step(Op.DROP, k, x))
            self._unlink(k)


def _release(counts: dict[Key, int], keys: Iterable[Key]) -> None:
    for k in keys:
        n = counts.get(k, 0)
        if n <= 1:
            counts.pop(k, None)
        else:
            counts[k] = n - 1
