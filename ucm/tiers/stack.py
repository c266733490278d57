"""TierStack: the ordered adapters of one cache, and the steps of plans run
against them.

Placement (ucm.placement) decides, under the cache's metadata lock, which
blocks go where and returns a Plan; the TierStack moves the bytes and
returns the steps that failed; the plan executor above it
(ucm/tiers/executor.py) decides what follows. It holds no lock across I/O
and never calls back up. Steps that name the same key reach the adapters in
the order they were planned, whichever threads run them; steps of different
keys run in parallel. This is the two-phase protocol of vLLM's offload manager
(`prepare_store` / `complete_store`), per block:

- prepare: `admit(plan, parent_of)`, called under the owner's metadata lock
  right after the plan was made, gives every step the next sequence number
  of its key (its generation) and records the parent each block is written
  with. Cheap: no adapter is called.
- run: `run(ticket, sources)` executes the steps in order, each once the
  earlier steps of its key are done, with no lock held. A step that fails
  stays in its key's queue and is returned (a `Failure`).
- complete: the executor reconciles each failure under its metadata lock: the
  copy the step did not make (and, for a read that found nothing, the
  source copy) is taken back out of the placement unless a step planned
  after the failure writes that tier again (`later_steps`: the key's
  generation moved on, and that step settles the copy); it admits the undo,
  calls `done(failure)`, and the undo runs.

Blobs under a key never change, so reordering across keys can cost a miss,
never wrong bytes; the per-key order keeps the adapters' contents what the
placement records (no block written after its eviction ran, no delete of a
newer copy).

Room the placement counted is not free in the medium yet while the step
that frees it (a MOVE or DROP out of the tier, planned by another thread: the
headroom thread, another store) has not run. A write or a staging copy into a
slot tier that finds no slot then waits for the frees admitted before the
failure (`wait_frees`, at most FREE_WAIT_TIMEOUT_S, no lock held; the
executor asks for it) and is tried again, rather than taken back as a miss.
(In a slab arena the counted room may also lie in free extents too scattered
for a unit of the size; the frees in flight, whole units, are what makes it
usable.)

Lock order: the owner's metadata lock, then `_order` (a leaf; never held
while an adapter is called), and apart from that an adapter's own lock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from ucm.adapters.base import Key, ReadAhead, SharedSlots, Status, StorageAdapter
from ucm.tiers.key_order import KeyOrder
from ucm.placement.plans import Op, Plan, Step

log = logging.getLogger(__name__)

# How long a step that found no slot waits for the frees planned before it
# (MOVE / DROP steps out of that tier that other threads run) to land.
FREE_WAIT_TIMEOUT_S = 5.0

# read(adapter, keys, views) -> one Status per key: a batched read into reserved slots
BatchRead = Callable[[StorageAdapter, list, list], list]


def _get(adapter: StorageAdapter, keys: list, views: list) -> list:
    return adapter.get(keys, views)


@dataclass(slots=True)
class Ticket:
    """An admitted plan: its steps with their per-key sequence numbers and
    the parent each written block carries to its tier."""

    steps: list[tuple[Step, int]]
    parents: dict[Key, Optional[Key]] = field(default_factory=dict)


@dataclass(slots=True)
class Failure:
    """A step that failed. `queued`: still at the head of its key's queue
    until `done` (False: dequeued at once, because a later step of its own
    ticket names the key and waits for it)."""

    step: Step
    seq: int
    status: Status
    queued: bool = True  # False: dequeued at once (a later step of its ticket names the key)
    # NO_SPACE while steps that free room in its tier (admitted before the
    # failure, by any thread) had not run yet: the seq bounding them, to wait
    # for before a retry (the room the placement counted was still taken).
    freeing: Optional[int] = None
    # NO_SPACE in a slot tier: the bytes of the block that found no slot (the
    # caller's buffer, else the source tier's copy; None when unknown). What
    # the arena's `victims_for` sizes its class by: the placement holds only
    # the block's footprint, which may round to another class.
    size_bytes: Optional[int] = None


def has_slots(a: StorageAdapter) -> bool:
    """Whether `a` hands out slots to fill or read in place (reserve/commit/
    lease: the shared-memory landing tier)."""
    return isinstance(a, SharedSlots)


class TierStack:
    """The adapters of one cache, fastest first, and the steps run on them."""

    def __init__(self, adapters: Sequence[StorageAdapter], names: Sequence[str]) -> None:
        self.adapters = list(adapters)
        self.names = list(names)
        self.shared = [t for t, a in enumerate(self.adapters) if a.shared]
        self._order = KeyOrder()
        self.corrupt = 0  # CORRUPT statuses met while moving blocks (the owner counts them)

    # ---- prepare -----------------------------------------------------------
    def admit(self, plan: Plan, parent_of: Callable[[Key], Optional[Key]]) -> Ticket:
        """Queues the plan's steps under their keys; call under the owner's
        metadata lock, right after the plan was made."""
        seqs = self._order.admit(plan)
        parents = {s.key: parent_of(s.key) for s in plan if s.op is not Op.DROP}
        return Ticket(list(zip(plan, seqs)), parents)

    def later_steps(self, failure: Failure) -> list[Step]:
        """The steps planned for the failure's key after it (still queued).
        Call under the owner's metadata lock, which every admission holds,
        so the answer stays true until the lock is let go."""
        return self._order.after(failure.step.key, failure.seq)

    def done(self, failure: Failure) -> None:
        if failure.queued:
            self._order.done(failure.step.key, failure.seq)

    def pending_steps(self) -> int:
        return self._order.pending()

    # ---- run ---------------------------------------------------------------
    def run(self, ticket: Ticket, sources: Mapping[Key, Any], read: Optional[BatchRead] = None) -> list[Failure]:
        """Executes the admitted steps in order, no lock held. COPY steps in a
        row from one tier to a slot tier are read as one batch (in parallel on
        the adapter's I/O threads). Returns the failed steps, still queued
        (a failed step that is not its key's last in the ticket is dequeued at
        once, so that the later step can run, and returned all the same).
        Steps never plan anything themselves: a slot tier without a slot of
        the size asked is a NO_SPACE failure the executor answers (its
        `reconcile` makes the slot and retries the step).
        `read(adapter, keys, views)` replaces the adapter's `get` in those
        batched reads (a streamed load reads them layer by layer,
        ucm/cache/streaming.py)."""
        failures: list[Failure] = []
        steps = ticket.steps
        last = {s.key: i for i, (s, _) in enumerate(steps)}

        def failed(i: int, step: Step, seq: int, st: Status) -> None:
            if st is Status.CORRUPT:
                self.corrupt += 1
            freeing = size = None
            if st is Status.NO_SPACE and step.op in (Op.WRITE, Op.COPY) and has_slots(self.adapters[step.dst]):
                freeing = self._order.frees_before(step.dst)
                size = self._payload_bytes(step, sources.get(step.key))
            if last[step.key] > i:  # the later step waits for this one: let it go now
                self._order.done(step.key, seq)
                failures.append(Failure(step, seq, st, queued=False, freeing=freeing, size_bytes=size))
            else:
                failures.append(Failure(step, seq, st, freeing=freeing, size_bytes=size))

        self._read_ahead(steps, sources)
        i = 0
        while i < len(steps):
            step, seq = steps[i]
            if step.op is Op.COPY and sources.get(step.key) is None and self._batchable(step):
                j = i
                while j < len(steps) and steps[j][0].op is Op.COPY and (steps[j][0].src, steps[j][0].dst) == (
                        step.src, step.dst) and sources.get(steps[j][0].key) is None:
                    j += 1
                for k, st in self._copy_batch(steps[i:j], read):
                    failed(k + i, *steps[k + i], st)
                i = j
                continue
            self._order.wait_turn(step.key, seq)
            st = self._execute(step, seq, sources.get(step.key), ticket.parents.get(step.key))
            if st is Status.OK:
                self._order.done(step.key, seq)
            else:
                failed(i, step, seq, st)
            i += 1
        return failures

    def _execute(self, step: Step, seq: int, have: Any, parent: Optional[Key]) -> Status:
        if step.op is Op.DROP:
            try:
                self.delete(step.src, step.key)
            finally:
                self._order.freed(step.src, seq)
            return Status.OK
        try:
            if step.op is Op.WRITE:
                st = self.put_block(step.dst, step.key, have, parent)
            else:
                st = self._transfer(step.key, step.src, step.dst, have, parent)
        except Exception:  # a tier that raises is a failed step, never a slot left behind
            log.exception("ucm: %s of a block to tier %s failed", step.op.name.lower(), self.names[step.dst])
            st = Status.FAILED
        if step.op is Op.MOVE:
            try:
                self.delete(step.src, step.key)
            finally:
                self._order.freed(step.src, seq)
        if st is not Status.OK:
            self.delete(step.dst, step.key)
        return st

    def _payload_bytes(self, step: Step, have: Any) -> Optional[int]:
        """The bytes of the block a WRITE or COPY step carries: the caller's
        buffer (a buffer-protocol object or a tensor), else the source
        tier's copy; None when that is gone or the tier fails."""
        try:
            if have is not None:
                n = getattr(have, "nbytes", None)
                return n if isinstance(n, int) else memoryview(have).nbytes
            return None if step.src is None else self.adapters[step.src].size_of(step.key)
        except Exception:  # a tier that raises: the step stays a failure, its size unknown
            log.warning("ucm: the size of a block in tier %s is unknown: the tier failed", step.src, exc_info=True)
            return None

    def _read_ahead(self, steps: Sequence[tuple[Step, int]], sources: Mapping[Key, Any]) -> None:
        """The ticket's first batch of COPY steps, when other steps come
        before it (a staging's demotions, which free its slots) and its
        source tier reads ahead (ReadAhead: the codec tier reads into its
        own memory first): that tier starts reading the batch now, so its
        reads overlap those steps. A hint: a fault here changes nothing."""
        for i, (step, _) in enumerate(steps):
            if step.op is Op.COPY and sources.get(step.key) is None and self._batchable(step):
                a = self.adapters[step.src]
                if i == 0 or not isinstance(a, ReadAhead):
                    return
                keys = []
                for s, _ in steps[i:]:
                    if s.op is not Op.COPY or (s.src, s.dst) != (step.src, step.dst) or sources.get(s.key) is not None:
                        break
                    keys.append(s.key)
                try:
                    a.read_ahead(keys)
                except Exception:
                    log.exception("ucm: a read ahead of %d blocks in tier %s failed", len(keys), self.names[step.src])
                return

    def _batchable(self, step: Step) -> bool:
        return has_slots(self.adapters[step.dst]) and not has_slots(self.adapters[step.src])

    def _copy_batch(self, group: Sequence[tuple[Step, int]], read: Optional[BatchRead] = None) -> list[tuple[int, Status]]:
        """COPY steps from one tier into a slot tier: one adapter read into
        the reserved slots. Returns (index in group, status) per failure;
        the successful steps are dequeued."""
        src, dst = group[0][0].src, group[0][0].dst
        a, b = self.adapters[src], self.adapters[dst]
        failures: list[tuple[int, Status]] = []
        keys, views, taken = [], [], []
        for n, (step, seq) in enumerate(group):
            self._order.wait_turn(step.key, seq)
            try:
                size = a.size_of(step.key)
                view = b.reserve(step.key, size) if size is not None else None
            except Exception:
                log.exception("ucm: reserving a slot in tier %s failed", self.names[dst])
                size, view = 0, None
            if view is None:
                failures.append((n, Status.NOT_FOUND if size is None else Status.NO_SPACE))
            else:
                keys.append(step.key)
                views.append(view)
                taken.append(n)
        try:
            statuses = ((read or _get)(a, keys, views)) if keys else []
        except Exception:  # a fault is a miss; the reserved slots are given back below
            log.exception("ucm: reading %d blocks from tier %s failed", len(keys), self.names[src])
            statuses = [Status.FAILED] * len(keys)
        for n, view, st in zip(taken, views, statuses):
            step, seq = group[n]
            try:
                view.release()
                if st is Status.OK and b.commit(step.key):
                    self._order.done(step.key, seq)
                    continue
                b.abort(step.key)
            except Exception:  # a tier that raises is a failed step, never a key left queued
                log.exception("ucm: settling a slot in tier %s failed", self.names[dst])
                st = Status.FAILED
            failures.append((n, st if st is not Status.OK else Status.FAILED))
        return sorted(failures)

    # ---- single-block operations ---------------------------------------------
    def reserve_after_frees(self, t: int, key: Key, size: int) -> Optional[memoryview]:
        """Tier t's `reserve(key, size)`, tried again once the frees out of t
        already planned ran (`wait_frees`) when the tier has no slot of that
        size. None: still no slot (the executor may then make one,
        `PlanExecutor.reserve_slot`)."""
        a = self.adapters[t]
        view = a.reserve(key, size)
        if view is None and has_slots(a):
            bound = self._order.frees_before(t)
            if bound is not None:
                self.wait_frees(t, bound)
                view = a.reserve(key, size)
        return view

    def wait_frees(self, t: int, seq: int) -> None:
        """Waits (at most FREE_WAIT_TIMEOUT_S, no lock held) until the steps
        freeing room in tier t admitted up to `seq` ran (`Failure.freeing`)."""
        if not self._order.wait_frees(t, seq, FREE_WAIT_TIMEOUT_S):
            log.warning("ucm: steps freeing room in tier %s took over %.0f s", self.names[t], FREE_WAIT_TIMEOUT_S)

    def put_block(self, t: int, key: Key, src: Any, parent: Optional[Key]) -> Status:
        """Tier t's `put_with_parents` of one block."""
        return self.adapters[t].put_with_parents([key], [src], [parent])[0]

    def delete(self, t: int, key: Key) -> None:
        """Tier t's delete of one block; a tier that raises is logged (the
        placement has already let the block go)."""
        try:
            self.adapters[t].delete([key])
        except Exception:
            log.exception("ucm: deleting a block from tier %s failed", self.names[t])

    def get_anywhere(self, key: Key, view: memoryview, skip: int) -> tuple[Status, Optional[int]]:
        """A read of a block that was not where the placement said (moved by
        a demotion running meanwhile): every other tier, fastest first, until
        one has it. Returns the status and the tier that answered it (None
        when none has the block)."""
        for t, a in enumerate(self.adapters):
            if t != skip:
                try:
                    st = a.get([key], [view])[0]
                except Exception:
                    log.exception("ucm: reading a block from tier %s failed", self.names[t])
                    continue
                if st is not Status.NOT_FOUND:
                    return st, t
        return Status.NOT_FOUND, None

    def _transfer(self, key: Key, src: int, dst: int, have: Any, parent: Optional[Key]) -> Status:
        """Copies one block between tiers (through the caller's buffer when
        it already holds the bytes, else through a staging buffer); `parent`
        goes with it to the destination."""
        if have is not None:
            return self.put_block(dst, key, have, parent)
        a = self.adapters[src]
        if has_slots(a):  # zero-copy read out of a shared-memory slot
            held = a.lease(key)
            if held is None:
                return Status.NOT_FOUND
            try:
                return self.put_block(dst, key, held.view, parent)
            finally:
                a.release(held)
        size = a.size_of(key)
        if size is None:
            return Status.NOT_FOUND
        b = self.adapters[dst]
        if has_slots(b):  # read straight into the destination slot
            view = b.reserve(key, size)
            if view is None:
                return Status.NO_SPACE
            try:
                st = a.get([key], [view])[0]
            finally:
                view.release()
            if st is Status.OK and b.commit(key):
                return st
            b.abort(key)
            return st if st is not Status.OK else Status.FAILED
        staging = bytearray(size)
        st = a.get([key], [staging])[0]
        return self.put_block(dst, key, staging, parent) if st is Status.OK else st

    # ---- whole stack -----------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        ok = True
        for a in self.adapters:
            ok = a.flush(timeout_s=timeout_s) and ok
        return ok

    def close(self) -> None:
        for a in self.adapters:
            try:
                a.close()
            except Exception:  # closing the rest matters more
                log.exception("closing tier %s failed", a.name)
