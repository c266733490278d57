"""The plans of one cache, from the placement to the tiers and back.

The placement engine (ucm.placement) decides under the cache's metadata
lock and returns Plans; `TierStack` (ucm.tiers.stack) runs their steps with
no lock held and returns the steps that failed; this class is the seam
between the two and the layer that decides what follows: it admits each
plan to the TierStack under the metadata lock, runs it, and answers the
failed steps round by round (`run`: `reconcile` under the lock, the copies
a failed step did not make leave the placement, or a NO_SPACE in a slot
tier is retried once the frees planned before it ran or after
`slot_evictions` free a slot of that size; then the undo and retries run,
no lock held). A reservation that finds no slot is answered the same way
(`reserve_slot`). The TierStack never calls back into this class or the
placement. It also records what the tiers hold at start-up (`restore`) and
blocks found only in a shared tier (`adopt_shared`), forgets blocks found
bad (`forget`) and those an adapter dropped on its own (`drain_dropped`).

Lock order: `meta` (the owner's metadata lock), then the TierStack's order
lock, then an adapter's own lock (`slot_evictions` asks a slab arena for
victims under `meta`).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ucm.adapters.base import SharedSlots, Status
from ucm.api import Key
from ucm.placement.base import PlacementEngine
from ucm.placement.plans import Op, Plan, Step
from ucm.tiers.stack import BatchRead, Failure, Ticket, TierStack

log = logging.getLogger(__name__)


def after_evictions(key: Key) -> tuple:
    """The mark of a NO_SPACE step retried once after the slot evictions
    another failure of the same reconcile pass planned for its size."""
    return ("after-evictions", key)


def retry_after_frees(key: Key) -> tuple:
    """The mark, in `run`'s `retried` set, of a NO_SPACE step retried once
    the frees planned before it ran (at most once per key and run)."""
    return ("after-frees", key)


class PlanExecutor:
    """Runs the placement's plans on a TierStack and reconciles failures."""

    def __init__(self, placement: PlacementEngine, tiers: TierStack, meta: threading.Lock,
                 count: Callable[[str, int], None], footprint: Callable[[int], int]) -> None:
        self.placement = placement
        self.tiers = tiers
        self.meta = meta
        self.count = count
        self.footprint = footprint

    def admit(self, plan: Plan) -> Ticket:
        """The plan admitted to the TierStack; call under `meta`, right after
        the plan was made."""
        return self.tiers.admit(plan, self.placement.parent_of)

    def run(self, ticket: Ticket, sources: Mapping[Key, Any], read: Optional[BatchRead] = None) -> bool:
        """Runs an admitted plan (no lock held), then, round by round, the
        reconciliation of the steps that failed (`reconcile`, under `meta`)
        and the plan it makes, until nothing is left. Returns whether every
        step of `ticket` succeeded (retried steps that then succeeded
        count). `read` replaces the batched reads into slots (TierStack.run)."""
        tiers = self.tiers
        failures = tiers.run(ticket, sources, read)
        retried: set = set()
        ok = True
        while failures:
            before, marks = len(retried), set(retried)
            try:
                undo = self.reconcile(failures, retried)
            except Exception:  # never leave a key's queue blocked behind a failure
                log.exception("ucm: reconciling %d failed steps failed", len(failures))
                for f in failures:
                    tiers.done(f)
                return False
            if len(retried) - before < len(failures):  # some were taken back, not retried
                ok = False
            for f in failures:  # no lock held, none of this ticket's steps queued any more
                mark = retry_after_frees(f.step.key)
                if f.freeing is not None and mark in retried and mark not in marks:
                    tiers.wait_frees(f.step.dst, f.freeing)
            failures = tiers.run(undo, sources, read) if undo is not None else []
        return ok

    def run_plan(self, plan: Plan, sources: Mapping[Key, Any]) -> bool:
        """Admits a plan just made by the placement (call right after making
        it; a single-threaded caller such as the payload replay may make it
        without the lock), runs it, reconciles its failures. Returns
        whether every step succeeded."""
        with self.meta:
            ticket = self.admit(plan)
        return self.run(ticket, sources)

    def reconcile(self, failures: list[Failure], retried: set) -> Optional[Ticket]:
        """The failed steps of one round of `run`, under `meta`. A failed step means
        its destination tier does not hold the block, and for a MOVE or COPY
        that read nothing (NOT_FOUND, CORRUPT) that the source does not hold
        a good copy either. Each such copy is taken back out of the
        placement (with the descendants that lose their prefix) unless a
        step planned after the failure writes that tier again (it settles
        that copy itself: the generation check). NO_SPACE in a tier with
        size classes is retried instead: when steps planned before it that
        free room there had not run (`Failure.freeing`: the room this
        placement counted was still taken, e.g. by a headroom demotion in
        flight), once after they ran (`run` waits for them, no lock
        held); else once after evictions that free a slot of that size
        (`Failure.size_bytes`, the block's own bytes; without them the copy
        is taken back out).
        Every failure is dequeued; returns the plan to run next (undo and
        retries)."""
        p = self.placement
        plan: Plan = []
        evicting: set[tuple[int, int]] = set()  # (tier, size) whose slot evictions this pass planned
        with self.meta:
            for f in failures:
                step, key = f.step, f.step.key
                later = self.tiers.later_steps(f)
                rewritten = {s.dst for s in later if s.op is not Op.DROP}
                if step.dst in rewritten or step.op is Op.DROP:
                    pass
                elif (f.status is Status.NO_SPACE and step.op in (Op.WRITE, Op.COPY) and f.freeing is not None
                        and retry_after_frees(key) not in retried and step.dst in p.tiers_of(key)):
                    retried.add(retry_after_frees(key))
                    plan.append(step)
                    continue
                elif (f.status is Status.NO_SPACE and step.op in (Op.WRITE, Op.COPY) and key not in retried
                        and step.dst in p.tiers_of(key)):
                    size = f.size_bytes  # the block's bytes: p.size_of is its footprint, maybe another class
                    if (step.dst, size) in evicting and after_evictions(key) not in retried:
                        # Evictions for this size are planned in this pass but not run: the arena
                        # would name the same blocks again, which placement no longer has in the
                        # tier, and then blocks of the batch itself. Tried again after them.
                        retried.add(after_evictions(key))
                        plan.append(step)
                        continue
                    evictions = self.slot_evictions(step.dst, key, size) if size is not None else []
                    retried.add(key)
                    if evictions:
                        evicting.add((step.dst, size))
                    if evictions or size is not None:
                        # No victim named: the arena has a slot of that size free
                        # by now (a concurrent free landed) or none can be made;
                        # one more try tells which.
                        plan.extend(evictions)
                        plan.append(step)
                        continue
                    plan.extend(p.remove(key, step.dst))
                elif step.dst in p.tiers_of(key):
                    plan.extend(p.remove(key, step.dst))
                if (step.op is Op.COPY and f.status in (Status.NOT_FOUND, Status.CORRUPT)
                        and step.src not in rewritten and step.src in p.tiers_of(key)):
                    if f.status is Status.CORRUPT:  # bad bytes: deleted, through the key's queue
                        plan.append(Step(Op.DROP, key, src=step.src))
                    plan.extend(p.remove(key, step.src))  # the source copy is gone or bad too
            ticket = self.admit(plan) if plan else None
        for f in failures:
            self.tiers.done(f)
        return ticket

    def reserve_slot(self, t: int, key: Key, size: int) -> Optional[memoryview]:
        """Tier t's `reserve(key, size)`, tried again when the tier has no
        slot of that size: once the frees out of t already planned ran
        (`TierStack.reserve_after_frees`), then once after evictions that
        free a slot of that size (`slot_evictions`, planned under `meta`,
        run without it). None: no slot. Caller holds no lock."""
        view = self.tiers.reserve_after_frees(t, key, size)
        if view is None and isinstance(self.tiers.adapters[t], SharedSlots):
            with self.meta:
                plan = self.slot_evictions(t, key, size)
                ticket = self.admit(plan) if plan else None
            if ticket is not None:
                self.run(ticket, {})
                view = self.tiers.adapters[t].reserve(key, size)
        return view

    def slot_evictions(self, t: int, key: Key, size: int) -> Plan:
        """Tier t found no slot for the `size` bytes of `key` (the payload's
        size, which the arena rounds to its class; not the footprint
        Placement counts) although Placement made room by
        bytes (the freed bytes lie in extents of another size class of a
        slab arena, ucm.adapters.slab). Asks the adapter which blocks to give
        up (`victims_for`), first those Placement may evict in prefix order,
        else with parents demoted ahead of their children, and evicts them
        through Placement (`evict_keys`: demoted like any victim). Caller
        holds `meta` (the adapter's lock is a leaf under it)."""
        a = self.tiers.adapters[t]
        if not isinstance(a, SharedSlots):
            return []
        p = self.placement
        protect = p.parent_of(key)
        for relaxed in (False, True):
            def acceptable(keys: tuple[Key, ...], relaxed: bool = relaxed) -> bool:
                return p.may_evict(t, keys, protect=protect, relaxed=relaxed)

            v = a.victims_for(size, acceptable)
            if v.keys:
                plan = p.evict_keys(t, v.keys, any_one=v.any_one, protect=protect, relaxed=relaxed)
                if plan:
                    self.count("slot_evictions", sum(s.src == t and s.op in (Op.MOVE, Op.DROP) for s in plan))
                    return plan
        return []

    def forget(self, key: Key, tier: int) -> None:
        """Tier `tier`'s copy of `key` was bad (CORRUPT, FAILED): deleted
        there, through the key's queue, and taken out of the placement."""
        with self.meta:
            ticket = self.admit([Step(Op.DROP, key, src=tier), *self.placement.remove(key, tier)])
        self.run(ticket, {})

    def drain_dropped(self) -> None:
        for t, a in enumerate(self.tiers.adapters):
            dropped = a.drain_dropped()
            if not dropped:
                continue
            with self.meta:
                plan: Plan = []
                for key in dropped:
                    plan.extend(self.placement.remove(key, t))
                ticket = self.admit(plan)
            self.run(ticket, {})

    def adopt_shared(self, keys: Sequence[Key], idx: Iterable[int]) -> None:
        """Records the blocks of keys[i] (i in idx) that only a shared tier
        holds (put there by another node), each under keys[i-1] when that is
        cached, so that the usual paths can load and promote them. Caller
        holds no lock."""
        shared = self.tiers.shared
        if not shared:
            return
        with self.meta:
            unknown = [i for i in idx if not self.placement.contains(keys[i])]
        for i in unknown:
            self._adopt(shared, keys[i], keys[i - 1] if i else None)

    def _adopt(self, shared: Sequence[int], key: Key, parent: Optional[Key]) -> None:
        for t in shared:
            try:
                size = self.tiers.adapters[t].size_of(key)
            except Exception:
                log.debug("shared tier %s failed in size_of", self.tiers.names[t], exc_info=True)
                continue
            if size is None:
                continue
            with self.meta:
                if self.placement.contains(key):
                    return
                if parent is not None and not self.placement.contains(parent):
                    parent = None
                d = self.placement.insert(key, parent, self.footprint(size), tier=t, restored=True)
                ticket = self.admit(d.plan)
            self.run(ticket, {})
            if d.placed:
                return

    def restore(self) -> None:
        """Records the blocks tiers hold at start (a restarted NVMe log),
        each under its recorded parent when that parent is restored too
        (parents first), so the prefix tree survives the restart; a block
        whose parent is not cached anywhere is recorded as a root."""

        def parents_first(entries: Mapping[Key, Any]) -> list[Any]:
            """The entries (key -> BlockEntry), each after its parent when the
            parent is among them. A cycle (garbage parents) is broken where
            the walk meets it: that entry comes first, as a root."""
            order: list[Any] = []
            done: set[Key] = set()
            for key in entries:
                path: list[Key] = []
                on_path: set[Key] = set()
                k: Optional[Key] = key
                while k is not None and k in entries and k not in done and k not in on_path:
                    path.append(k)
                    on_path.add(k)
                    k = entries[k].parent
                for k in reversed(path):
                    order.append(entries[k])
                    done.add(k)
            return order

        for t, a in enumerate(self.tiers.adapters):
            if a.shared:
                continue  # other nodes' blocks: asked for on demand
            entries = {e.key: e for e in a.iter_entries()}
            for e in parents_first(entries):
                with self.meta:
                    par = e.parent if e.parent is not None and self.placement.contains(e.parent) else None
                    d = self.placement.insert(e.key, par, self.footprint(e.size_bytes), tier=t, restored=True)
                    kept = d.placed or self.placement.contains(e.key)
                    ticket = self.admit(d.plan)
                self.run(ticket, {})
                if not kept:
                    a.delete([e.key])

