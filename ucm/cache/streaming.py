"""LayerStreamer: a cache's streamed loads (ucm.layer_stream), in the
process of the cache (an engine's own UnifiedCache, or `ucm serve`).

A stream leases, at once, the blocks already in the landing tier; the
others are staged as a reader's staging is (`Stager.stage`, forced,
planned in one hold of the metadata lock, the staged blocks held until
leased), except that the batched read of the blocks into their reserved
slots is replaced by one range read per layer (`read_range`: verified per
32 KiB chunk on nvme, per chunk table on fs, whole-blob fallback elsewhere),
every layer submitted at once to a pool of `threads` threads in layer
order, so that layer 0 lands first while later layers are still being
read (at least `SPAN_BYTES` of a block per read). A tier
without range reads (redis, mooncake) is read a whole block at a time, as
a staging reads it: a range from it would cost a whole-blob read each. A
codec tier (LayerReads) reads and verifies its blocks' frames once, then
decodes range of layers by range across the blocks (4 ranges at most,
ucm/codecs/tier.py), landing the first range of every block before
decoding the next. Each landed layer advances its block's progress word; a layer that
fails (missing, corrupt, I/O error) makes its block FAILED at once (the
reads of its later layers are skipped) and the staging step fails as a
whole read would (the slot is aborted, a corrupt copy forgotten). A block
is DONE at the end only once committed and leased to the stream.

A failed block's slot is aborted while its reader may still copy an
earlier layer of it out: those bytes go only into pages the reader reports
as load errors (vLLM recomputes them), never into a block reported DONE.

Threads: `start` runs on the caller's thread and returns once every block
has its slot (or failed), at most `SLOTS_TIMEOUT_S`; the staging runs on a
job pool of `JOB_THREADS` threads (one per stream in flight), the layer
reads on the layer pool.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from ucm.accelerators.base import BlocksLoaded
from ucm.adapters.base import LayerReads, RangeReads, Status, StorageAdapter, read_range
from ucm.api import Key, Outcome
from ucm.cache.blocks import BlockIO
from ucm.cache.core import CacheCore
from ucm.cache.staging import Stager
from ucm.layer_stream import LayerStream, StreamProgress, word_count

log = logging.getLogger(__name__)

SLOTS_TIMEOUT_S = 30.0
# Streams staged at once. A staging job holds its thread until every layer
# of its blocks was read (and any staging it joined ended), and `start`
# waits for its job to begin: with fewer threads than streams in flight (a
# step of several requests, several engines on one service) a stream's
# `start` waited for an earlier stream's whole load.
JOB_THREADS = 16
# Bytes of each block one range read covers at least (whole layers): small
# reads cost more per byte on the medium and in Python than they gain.
SPAN_BYTES = 192 * 1024  # a few layers of a typical block: large enough for the medium, small enough to land early


class CacheStream(LayerStream):
    """A stream served by a LayerStreamer in this process."""

    def __init__(self, keys: Sequence[Key], sizes: Sequence[int], layers: int, arena: Any,
                 progress: StreamProgress, on_done: Optional[Callable[["CacheStream"], None]]) -> None:
        self.keys = list(keys)
        self.sizes = list(sizes)
        self.layers = layers
        self.arena = arena
        self.progress = progress
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.slots: list[Optional[tuple[int, int]]] = [None] * len(keys)
        self.leases: list[Any] = [None] * len(keys)
        self.served: list[Optional[str]] = [None] * len(keys)  # the tier each block is taken from
        self.pending: set[int] = set()
        self.slots_known = threading.Event()
        self._lock = threading.Lock()
        self._released = False
        self._finished = False
        self._given_back = False
        self._release_leases: Callable[[list], None] = lambda leases: None
        self._on_done = on_done

    # ---- LayerStream ---------------------------------------------------------
    def wait_layer(self, layer: int, timeout_s: float) -> list[bool]:
        return self.progress.wait_landed(layer, timeout_s)

    def outcomes(self, timeout_s: float) -> list[Outcome]:
        if not self.progress.wait_finished(timeout_s):
            return [Outcome.FAILED] * len(self.keys)
        return self.progress.final()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            give = self._finished
        if give:
            self._give_back()

    # ---- the streamer's side ---------------------------------------------------
    def publish(self, i: int, slot: Optional[tuple[int, int]]) -> None:
        with self._lock:
            self.slots[i] = slot
            self.pending.discard(i)
            if not self.pending:
                self.slots_known.set()

    def set_release(self, release_leases: Callable[[list], None]) -> None:
        """How the stream's leases go back (to the arena that lent them)."""
        self._release_leases = release_leases

    def close_pending(self) -> None:
        """`start`'s end: blocks still without a slot are misses; the slots
        are what the reader sees from now on."""
        with self._lock:
            for i in self.pending:
                self.progress.fail(i)
            self.pending.clear()
            self.slots = list(self.slots)

    def abandon(self) -> None:
        """A stream that failed to start (no job runs for it): the leases it
        took go back, every block is a miss, the words are final."""
        with self._lock:
            leases, self.leases = [le for le in self.leases if le is not None], [None] * len(self.keys)
            self.slots = [None] * len(self.keys)
            self.pending.clear()
        try:
            self._release_leases(leases)
        except Exception:
            log.exception("ucm: giving back a failed stream's leases failed")
        self.progress.finish([False] * len(self.keys))
        self.finished()

    def finished(self) -> None:
        """The staging job ended; the words are final."""
        with self._lock:
            self._finished = True
            give = self._released
            self.slots_known.set()
        if self._on_done is not None:
            self._on_done(self)
        if give:
            self._give_back()

    def _give_back(self) -> None:
        with self._lock:
            if self._given_back:
                return
            self._given_back = True
            leases, self.leases = [le for le in self.leases if le is not None], [None] * len(self.keys)
        if leases:
            self._release_leases(leases)


class LayerStreamer:
    """Streamed loads of one cache (see the module docstring): its core, its
    block I/O (the scratch path) and its stager (the staged path)."""

    def __init__(self, core: CacheCore, blocks: BlockIO, stager: Stager, threads: int = 4,
                 span_bytes: Optional[int] = None) -> None:
        self._core = core
        self._blocks = blocks
        self._stager = stager
        self.span_bytes = span_bytes or SPAN_BYTES
        self._jobs = ThreadPoolExecutor(max_workers=JOB_THREADS, thread_name_prefix="ucm-stream")
        self._layer_pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucm-layer")

    def close(self) -> None:
        self._jobs.shutdown(wait=True)
        self._layer_pool.shutdown(wait=True)

    def start(self, keys: list[Key], sizes: list[int], layers: int, request_id: Optional[str],
              words: Optional[memoryview] = None,
              on_done: Optional[Callable[[CacheStream], None]] = None) -> CacheStream:
        """A stream of `keys` (sizes checked by the caller; each a multiple of
        `layers`). `words`: where to publish progress (word_count(len(keys))
        'I' items; default process memory). `on_done(stream)`: called once
        the words are final."""
        core = self._core
        n = len(keys)
        if words is None:
            words = memoryview(bytearray(4 * word_count(n))).cast("I")
        progress = StreamProgress(words, n, layers)
        arena = core.shared_arena()
        segment = arena.segment_view() if arena is not None else bytearray(sum(sizes))
        st = CacheStream(keys, sizes, layers, segment, progress, on_done)
        try:
            with core.meta:
                core.record_locked(keys, None, request_id)
            if arena is None:  # no shared slots: whole blocks into a scratch buffer, then every layer at once
                self._jobs.submit(self._scratch_job, st, request_id)
                return st
            st.set_release(lambda leases: [arena.release(le) for le in leases])
            need: list[int] = []
            for i, key in enumerate(keys):
                try:
                    lease = arena.lease(key)
                except Exception:
                    log.exception("ucm: leasing a slot for a stream failed")
                    lease = None
                if lease is None:
                    need.append(i)
                elif lease.length != sizes[i]:
                    arena.release(lease)
                    progress.fail(i)
                else:
                    st.leases[i] = lease
                    st.slots[i] = (lease.offset, lease.length)
                    progress.all_landed(i)
            landing = core.tier_names[core.landing]
            st.served = [landing if le is not None else None for le in st.leases]
            if need:
                with core.meta:
                    for i in need:
                        t = core.placement.where(keys[i])
                        st.served[i] = None if t is None else core.tier_names[t]
                st.pending = set(need)
                core.plans.adopt_shared(keys, need)
                self._jobs.submit(self._stage_job, st, need, arena, request_id)
        except Exception:  # a cache fault is a miss, never an exception (LayerStreams)
            log.exception("ucm: starting a streamed load failed; its blocks are misses")
            st.abandon()
            return st
        if not need:
            self._settle(st, request_id, staged=0)
            return st
        if not st.slots_known.wait(SLOTS_TIMEOUT_S):
            log.warning("ucm: a stream's slots took over %.0f s; its unplaced blocks are misses", SLOTS_TIMEOUT_S)
        st.close_pending()
        return st

    # ---- jobs -----------------------------------------------------------------
    def _stage_job(self, st: CacheStream, need: list[int], arena: Any, request_id: Optional[str]) -> None:
        core = self._core
        progress = st.progress

        def read(adapter: StorageAdapter, keys: list[Key], views: list[memoryview]) -> list[Status]:
            idx = [st.index[k] for k in keys]
            for i, k in zip(idx, keys):
                st.publish(i, arena.slot_offset(k))
            return self._read_layers(adapter, keys, views, idx, progress)

        def planned(others: list[Key]) -> None:
            # Blocks this staging does not copy: a slot another staging is
            # filling (joined: landed once that staging ends, in
            # lease_staged) or none (a miss, or placed since: found there at
            # the end). `start` then need not wait for the whole staging.
            for k in others:
                i = st.index.get(k)
                if i is not None and i in st.pending:
                    st.publish(i, arena.slot_offset(k))

        def lease_staged() -> None:  # still held: nothing evicted them since their commit
            for i in need:
                key = st.keys[i]
                lease = arena.lease(key)
                if lease is None:
                    continue
                slot = st.slots[i]
                if (slot is None or slot == (lease.offset, lease.length)) and progress.words[i] == 0 \
                        and lease.length == st.sizes[i]:
                    # staged whole by another path (joined): committed in that
                    # slot, so its bytes are the block's; nothing was reported
                    # landed before (word 0), so the reader copied none of it
                    st.publish(i, (lease.offset, lease.length))
                    progress.all_landed(i)
                    slot = st.slots[i]
                if slot is None or slot != (lease.offset, lease.length) or progress.words[i] != st.layers:
                    arena.release(lease)
                    continue
                st.leases[i] = lease

        try:
            self._stager.stage([st.keys[i] for i in need], force=True, then=lease_staged, read=read, planned=planned)
        except Exception:
            log.exception("ucm: a streamed staging failed; its blocks are misses")
        core.plans.drain_dropped()
        core.wake_reclaim()
        self._settle(st, request_id, staged=len(need))

    def _scratch_job(self, st: CacheStream, request_id: Optional[str]) -> None:
        offsets = [0]
        for s in st.sizes:
            offsets.append(offsets[-1] + s)
        view = memoryview(st.arena)
        try:
            out = self._blocks.load(st.keys, [view[offsets[i]:offsets[i + 1]] for i in range(len(st.keys))],
                                    request_id)
        except Exception:
            log.exception("ucm: a streamed load into scratch failed")
            out = [Outcome.FAILED] * len(st.keys)
        for i, o in enumerate(out):
            if o is Outcome.DONE:
                st.publish(i, (offsets[i], st.sizes[i]))
                st.progress.all_landed(i)
            else:
                st.progress.fail(i)
        st.progress.finish([o is Outcome.DONE for o in out])
        st.finished()

    def _read_layers(self, adapter: StorageAdapter, keys: list[Key], views: list[memoryview], idx: list[int],
                     progress: StreamProgress) -> list[Status]:
        """The blocks' layers in one range read per span of consecutive
        layers (`span_bytes` of each block at least, so the medium reads
        large enough), every span submitted at once (layer order); returns
        per block OK when all its layers landed, else its first failure."""
        layers = progress.layers
        if isinstance(adapter, LayerReads) and not isinstance(adapter, RangeReads):  # decoded layer by layer
            def landed(j: int, first: int, last: int) -> None:
                for layer in range(first, last):
                    progress.layer_landed(idx[j], layer)

            try:
                got = adapter.get_layers(keys, views, layers, landed)
            except Exception:
                log.exception("ucm: a streamed layer-by-layer read failed")
                got = [Status.FAILED] * len(keys)
            for j, s in enumerate(got):
                if s is not Status.OK:
                    progress.fail(idx[j])
            return list(got)
        if not isinstance(adapter, RangeReads):  # a range would cost a whole-blob read: read each block once
            try:
                got = adapter.get(keys, views)
            except Exception:
                log.exception("ucm: a streamed whole-block read failed")
                got = [Status.FAILED] * len(keys)
            for j, s in enumerate(got):
                if s is Status.OK:
                    progress.all_landed(idx[j])
                else:
                    progress.fail(idx[j])
            return list(got)
        status = [Status.OK if len(v) % layers == 0 else Status.CORRUPT for v in views]
        for j, s in enumerate(status):
            if s is not Status.OK:
                progress.fail(idx[j])
        lock = threading.Lock()
        layer_bytes = max((len(v) // layers for v in views), default=1) or 1
        per_span = max(1, min(layers, -(-self.span_bytes // layer_bytes)))

        def one(first: int) -> None:
            last = min(layers, first + per_span)
            with lock:
                live = [j for j, s in enumerate(status) if s is Status.OK]
            if not live:
                return
            widths = [len(views[j]) // layers for j in live]
            try:
                got = read_range(adapter, [keys[j] for j in live], [first * w for w in widths],
                                 [views[j][first * w:last * w] for j, w in zip(live, widths)])
            except Exception:
                log.exception("ucm: a layer range read failed")
                got = [Status.FAILED] * len(live)
            for j, s in zip(live, got):
                if s is Status.OK:
                    for layer in range(first, last):
                        progress.layer_landed(idx[j], layer)
                    continue
                with lock:
                    if status[j] is Status.OK:
                        status[j] = s
                progress.fail(idx[j])

        futures = [self._layer_pool.submit(one, first) for first in range(0, layers, per_span)]
        for f in futures:
            f.result()
        return status

    def _settle(self, st: CacheStream, request_id: Optional[str], staged: int) -> None:
        core = self._core
        done = [le is not None for le in st.leases]
        st.progress.finish(done)
        n_ok = sum(done)
        counters = core.counters
        counters.add("streams", 1)
        counters.add("streamed_blocks", staged)
        counters.add("loaded_blocks", n_ok)
        counters.add("missing_blocks", len(done) - n_ok)
        counters.add("bytes_loaded", sum(s for s, d in zip(st.sizes, done) if d))
        counters.add_served(t for t, d in zip(st.served, done) if d and t is not None)
        with core.meta:
            core.placement.touch([k for k, d in zip(st.keys, done) if d])
        if core.accelerators:
            core.accelerators.blocks_loaded(BlocksLoaded(
                tuple(st.keys), tuple(Outcome.DONE if d else Outcome.MISSING for d in done),
                tuple(t if d else None for t, d in zip(st.served, done)), request_id))
        st.finished()
