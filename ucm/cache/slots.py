"""The cache's slot API: zero-copy access to the landing tier's shared slots.

Writers `reserve` slots, fill them and `commit` (or `abort`); readers
`acquire` leases (staging blocks held below the landing tier first) and
`release` them. The service hands these slots to engine processes, which
copy in and out of the shared segment themselves; in-process callers use
`write_slots` / `read_slots` (ucm.api.CacheAPI), which fall back to a
scratch buffer when the landing tier declares no SharedSlots.

Acts on the cache's core (ucm/cache/core.py), with its block I/O (for the
scratch paths) and its stager (for blocks below the landing tier); owns the
cache's LayerStreamer (ucm/cache/streaming.py), made by the first stream.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

from ucm.accelerators.base import BlocksLoaded, BlocksStored
from ucm.adapters.base import SharedSlots
from ucm.api import Key, Outcome, SlotFn, check_keys, check_parent, check_request_id, check_sizes, cut_parts
from ucm.cache.blocks import BlockIO
from ucm.cache.core import CacheCore
from ucm.cache.staging import Stager
from ucm.cache.streaming import LayerStreamer
from ucm.errors import ArgumentError
from ucm.placement.plans import Op, Plan

log = logging.getLogger(__name__)

READ_PART_SHARE = 8  # a read_slots part stages at most 1/8 of the landing tier, as the client's parts of its arena


class SlotAccess:
    """reserve / commit / abort, acquire / release, write_slots / read_slots,
    stream_slots."""

    def __init__(self, core: CacheCore, blocks: BlockIO, stager: Stager) -> None:
        self._core = core
        self._blocks = blocks
        self._stager = stager
        self._streamer: Optional[LayerStreamer] = None  # made by the first stream_slots, under core.meta

    def shared_arena(self) -> Optional[SharedSlots]:
        """The landing tier when it declares shared slots (ucm.adapters.base.
        SharedSlots), else None."""
        return self._core.shared_arena()

    def close(self) -> None:
        """Ends the streamer's threads (after the cache's I/O pool ended)."""
        if self._streamer is not None:
            self._streamer.close()

    def reserve(self, keys: Sequence[Key], sizes: Sequence[int], parent: Optional[Key] = None,
                request_id: Optional[str] = None, counted: bool = True) -> list[Union[None, bool, memoryview]]:
        """Places consecutive blocks like `store` but hands back, per block, a
        writable slot view to fill and then `commit` (or `abort`); True when
        the block is already cached; None when refused (and every block
        after it, which would lack its parent). The whole run is planned
        under one hold of the metadata lock; a reserved block is held (not
        a victim) until it is committed or aborted. `counted` False: a later
        chunk of one call without a request id (its access counted once)."""
        arena = self.shared_arena()
        if arena is None:
            raise ArgumentError(f"reserve needs a shared-memory landing tier; landing is "
                                f"{self._core.tier_names[self._core.placement.landing]!r}")
        keys = check_keys(keys)
        sizes = check_sizes(keys, sizes)
        parent, request_id = check_parent(parent), check_request_id(request_id)
        landing = self._core.placement.landing
        p = self._core.placement
        placed: list[Union[None, bool]] = []  # per key: True placed, False present, None refused
        plan: Plan = []
        footprints = {size: self._core.footprint(size) for size in set(sizes)}  # a batch has one or few sizes
        with self._core.meta:
            self._core.record_locked(keys, parent, request_id, counted)
            for i, key in enumerate(keys):
                d = p.insert(key, keys[i - 1] if i else parent, footprints[sizes[i]])
                plan.extend(s for s in d.plan if s.op is not Op.WRITE)
                if d.placed:
                    p.hold([key])  # not a victim until committed or aborted
                    placed.append(True)
                elif p.contains(key):
                    placed.append(False)
                else:
                    break
            ticket = self._core.plans.admit(plan)
        self._core.plans.run(ticket, {})
        out: list[Union[None, bool, memoryview]] = []
        first_bad: Optional[int] = None
        for i, (key, size, state) in enumerate(zip(keys, sizes, placed)):
            if state is False:
                out.append(True)
                continue
            try:
                view = self._core.plans.reserve_slot(landing, key, size)
            except Exception:  # a tier that raises refuses the block; its hold and record go below
                log.exception("ucm: reserving a slot in tier %s failed", self._core.tier_names[landing])
                view = None
            if view is None:
                first_bad = i
                break
            out.append(view)
        if first_bad is not None or len(placed) < len(keys):
            self._core.counters.add("store_refused", 1)
        if first_bad is not None:  # it and the blocks after it (its descendants) are taken back
            with self._core.meta:
                p.unhold([k for k, state in zip(keys[first_bad:], placed[first_bad:]) if state])
                ticket = self._core.plans.admit(p.remove(keys[first_bad], landing))
            self._core.plans.run(ticket, {})
        out.extend([None] * (len(keys) - len(out)))
        with self._core.meta:
            p.touch([k for k, o in zip(keys, out) if o is not None])
        return out

    def commit(self, keys: Sequence[Key]) -> list[bool]:
        """Makes filled slots visible; False for a key with no reservation
        (it was taken back meanwhile)."""
        keys = check_keys(keys)
        arena = self.shared_arena()
        out = []
        committed = []
        sizes = []
        stored = 0
        for key in keys:
            slot = arena.slot_offset(key)
            ok = arena.commit(key)
            if ok:
                committed.append(key)
                sizes.append(slot[1])
                stored += slot[1]
            out.append(ok)
        if committed:
            with self._core.meta:
                self._core.placement.unhold(committed)
            self._core.counters.add("stored_blocks", len(committed))
            self._core.counters.add("bytes_stored", stored)
            self._core.write_through(committed)
            if self._core.accelerators:
                self._core.accelerators.blocks_stored(BlocksStored(
                    tuple(committed), tuple(sizes), self._core.tier_names[self._core.placement.landing], None))
        self._core.wake_reclaim()
        return out

    def abort(self, keys: Sequence[Key]) -> None:
        """Gives back reserved slots that will not be filled."""
        keys = check_keys(keys)
        arena = self.shared_arena()
        landing = self._core.placement.landing
        taken = []
        for key in keys:
            if arena.slot_offset(key) is None or arena.contains([key])[0]:
                continue  # no pending reservation: never placed, or committed (its holds are others')
            arena.abort(key)
            taken.append(key)
        if not taken:
            return
        undo: Plan = []
        with self._core.meta:
            for key in taken:
                self._core.placement.unhold([key])
                undo.extend(self._core.placement.remove(key, landing))
            ticket = self._core.plans.admit(undo)
        self._core.plans.run(ticket, {})

    def acquire(self, keys: Sequence[Key], request_id: Optional[str] = None, counted: bool = True) -> list[Any]:
        """Leases each block's slot in the shared-memory landing tier for
        reading, staging blocks held only below it first (synchronously).
        Per key: a Lease (its `view` is the blob) or None on a miss. Give
        every lease back with `release`."""
        arena = self.shared_arena()
        if arena is None:
            raise ArgumentError("acquire needs a shared-memory landing tier")
        keys = check_keys(keys)
        request_id = check_request_id(request_id)
        with self._core.meta:
            self._core.record_locked(keys, None, request_id, counted)
        leases = [arena.lease(key) for key in keys]
        staging = any(le is None for le in leases)
        landing = self._core.tier_names[self._core.placement.landing]
        tiers: list[Optional[str]] = [landing if le is not None else None for le in leases]
        if staging:
            self._core.plans.adopt_shared(keys, [i for i, le in enumerate(leases) if le is None])
            need = [i for i, le in enumerate(leases) if le is None]
            with self._core.meta:  # where each staged block comes from
                for i in need:
                    t = self._core.placement.where(keys[i])
                    tiers[i] = None if t is None else self._core.tier_names[t]

            def lease_staged() -> None:  # before the staged blocks may be evicted again
                for i in need:
                    leases[i] = arena.lease(keys[i])

            self._stager.stage([keys[i] for i in need], force=True, then=lease_staged)
        n_ok = sum(le is not None for le in leases)
        self._core.counters.add_served(t for t, le in zip(tiers, leases) if le is not None and t is not None)
        self._core.counters.add("missing_blocks", len(keys) - n_ok)
        self._core.counters.add("loaded_blocks", n_ok)
        self._core.counters.add("bytes_loaded", sum(len(le.view) for le in leases if le is not None))
        with self._core.meta:
            self._core.placement.touch([k for k, le in zip(keys, leases) if le is not None])
        self._core.plans.drain_dropped()
        if staging:
            self._core.wake_reclaim()
        if self._core.accelerators:
            self._core.accelerators.blocks_loaded(BlocksLoaded(
                tuple(keys), tuple(Outcome.DONE if le is not None else Outcome.MISSING for le in leases),
                tuple(t if le is not None else None for t, le in zip(tiers, leases)), request_id))
        return leases

    def release(self, leases: Sequence[Any]) -> None:
        arena = self.shared_arena()
        for lease in leases:
            if lease is not None:
                arena.release(lease)

    def write_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                    parent: Optional[Key] = None, request_id: Optional[str] = None) -> list[Outcome]:
        """The zero-copy store (ucm.api.CacheAPI): slots in the landing
        tier's shared slots when it has them (`fill` then writes straight
        into the tier), else in a scratch buffer stored afterwards."""
        keys = check_keys(keys)
        sizes = check_sizes(keys, sizes)
        parent, request_id = check_parent(parent), check_request_id(request_id)
        self._core.check_open()
        if not keys:
            return []
        arena = self.shared_arena()
        if arena is None:
            return self._write_via_scratch(keys, sizes, fill, parent, request_id)
        got = self.reserve(keys, sizes, parent, request_id=request_id)
        filled = [k for k, g in zip(keys, got) if isinstance(g, memoryview)]
        slots, out = [], []
        for k, g in zip(keys, got):
            if isinstance(g, memoryview):
                slots.append(arena.slot_offset(k))
                out.append(Outcome.DONE)
            else:
                slots.append(None)
                out.append(Outcome.DONE if g is True else Outcome.MISSING)
        for g in got:
            if isinstance(g, memoryview):
                g.release()
        if not filled:
            return out
        segment = arena.segment_view()
        try:
            fill(0, slots, segment)
        except Exception:
            log.warning("ucm: a fill into reserved slots raised; the chunk is aborted", exc_info=True)
            self.abort(filled)
            return [Outcome.FAILED if s is not None else o for s, o in zip(slots, out)]
        ok = dict(zip(filled, self.commit(filled)))
        return [Outcome.FAILED if not ok.get(k, True) else o for k, o in zip(keys, out)]

    def _write_via_scratch(self, keys: list[Key], sizes: list[int], fill: SlotFn, parent: Optional[Key],
                           request_id: Optional[str]) -> list[Outcome]:
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        scratch = bytearray(offsets[-1])
        with self._core.meta:
            cached = [self._core.placement.contains(k) for k in keys]
        try:
            fill(0, [None if cached[i] else (offsets[i], sizes[i]) for i in range(len(keys))], scratch)
        except Exception:
            log.warning("ucm: a fill into scratch slots raised; nothing is stored", exc_info=True)
            return [Outcome.FAILED] * len(keys)
        view = memoryview(scratch)
        # A block skipped as cached may have been evicted meanwhile: the
        # store stops before it rather than write its unfilled bytes.
        return self._blocks.store(keys, [view[offsets[i]:offsets[i + 1]] for i in range(len(keys))], parent, request_id,
                           filled=[not c for c in cached])

    def read_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                   request_id: Optional[str] = None) -> list[Outcome]:
        """The zero-copy load (ucm.api.CacheAPI): leases in the landing
        tier's shared slots when it has them, else a scratch buffer loaded
        first."""
        keys = check_keys(keys)
        sizes = check_sizes(keys, sizes)
        request_id = check_request_id(request_id)
        self._core.check_open()
        if not keys:
            return []
        arena = self.shared_arena()
        if arena is None:
            offsets = [0]
            for s in sizes:
                offsets.append(offsets[-1] + s)
            scratch = bytearray(offsets[-1])
            view = memoryview(scratch)
            out = self._blocks.load(keys, [view[offsets[i]:offsets[i + 1]] for i in range(len(keys))], request_id)
            slots = [(offsets[i], sizes[i]) if o is Outcome.DONE else None for i, o in enumerate(out)]
            return self._fill_out(slots, out, scratch, fill)
        with self._core.meta:  # the whole call is one access; its parts are not counted again
            self._core.record_locked(keys, None, request_id)
        out: list[Outcome] = []
        for i, j in self._read_parts(sizes):
            leases = self.acquire(keys[i:j], request_id=request_id, counted=False)
            try:
                slots, part = [], []
                for lease, size in zip(leases, sizes[i:j]):
                    if lease is None:
                        slots.append(None)
                        part.append(Outcome.MISSING)
                    elif lease.length != size:
                        slots.append(None)
                        part.append(Outcome.CORRUPT)
                    else:
                        slots.append((lease.offset, lease.length))
                        part.append(Outcome.DONE)
                out.extend(self._fill_out(slots, part, arena.segment_view(), fill, first=i))
            finally:
                self.release(leases)
        return out

    def _read_parts(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """`read_slots`' parts: index ranges of at most 1/READ_PART_SHARE of
        the landing tier's capacity (at least one block each), so that a hit
        longer than the landing tier is staged and copied part by part, as
        the service's client cuts its calls (ucm/service/client/slots.py),
        instead of losing every block past what the tier holds at once."""
        landing = self._core.adapters[self._core.landing]
        return cut_parts(sizes, max(1, landing.capacity_bytes // READ_PART_SHARE))

    def stream_slots(self, keys: Sequence[Key], sizes: Sequence[int], layers: int,
                     request_id: Optional[str] = None, words: Optional[memoryview] = None,
                     on_done: Optional[Any] = None) -> Any:
        """The streamed load (ucm.layer_stream.LayerStreams): slots now,
        bytes layer by layer (ucm/cache/streaming.py). `words` and `on_done` are
        the service's: progress words in its shared file, and a callback
        once they are final."""
        keys = check_keys(keys)
        sizes = check_sizes(keys, sizes)
        request_id = check_request_id(request_id)
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ArgumentError(f"stream_slots: layers must be an int >= 1, got {layers!r}")
        bad = [s for s in sizes if s % layers]
        if bad:
            raise ArgumentError(f"stream_slots: block sizes must be multiples of layers={layers}, got {bad[0]}")
        self._core.check_open()
        with self._core.meta:
            if self._streamer is None:
                self._streamer = LayerStreamer(self._core, self._blocks, self._stager)
            streamer = self._streamer
        return streamer.start(keys, sizes, layers, request_id, words, on_done)

    @staticmethod
    def _fill_out(slots: list, out: list[Outcome], arena: Any, fill: SlotFn, first: int = 0) -> list[Outcome]:
        if any(s is not None for s in slots):
            try:
                fill(first, slots, arena)
            except Exception:
                log.warning("ucm: a fill out of leased slots raised", exc_info=True)
                return [Outcome.FAILED if o is Outcome.DONE else o for o in out]
        return out

