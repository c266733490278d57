"""UnifiedCache: the one API (ucm.api.CacheAPI) over a stack of tiers.

`lookup`, `locate`, batched asynchronous `load` / `store` / `prefetch`
returning Handles with one Outcome per block, `pin` / `unpin`, `stats`, the
request events (`begin_request`, `request_id`) and the placement hint
`finish`; the slot API (zero-copy `write_slots` / `read_slots`, and the
`reserve` / `commit` / `abort`, `acquire` / `release` the service serves to
other processes) is in ucm/cache/slots.py; staging (and joining another
staging of the same block) in ucm/cache/staging.py; streamed loads in
ucm/cache/streaming.py; `stats` and the counters in ucm/cache/counters.py.

Layers. `ucm.placement.engine.Placement` decides (admission, eviction, demotion,
promotion) with the configured policy and returns Plans; `ucm.tiers.executor.
PlanExecutor` admits them to `ucm.tiers.stack.TierStack`, which runs them against
the adapters, and settles failed steps; `ucm.cache.reclaim` keeps headroom. This
class holds the one metadata lock, the request bookkeeping and the counters.

Threads. Any method may be called from any thread. Loads, stores and
prefetches run on a pool of `io_workers` threads. One lock, `_meta`, guards
the placement metadata and the request ids; it is held only to plan and to
reconcile, never across an adapter's I/O (the TierStack keeps each key's
steps in planning order instead; see ucm/tiers/stack.py). Blocks being read,
staged or reserved are held (`Placement.hold`), so they are never victims
meanwhile. Lock order: `_meta`, then the TierStack's order lock, then an
adapter's own lock (a slab arena is asked for victims under `_meta`);
`_counts_lock` is a leaf.

Faults. Nothing on the data path raises for a cache fault: a missing file, a
bad checksum, a failed write or a full medium is an Outcome (MISSING,
CORRUPT, FAILED) and the block is forgotten where it was bad.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ucm.accelerators.base import BlocksLoaded, BlocksStored, RequestFinished, RequestSeen
from ucm.accelerators.chain import Accelerators
from ucm.adapters.base import Status, StorageAdapter, load_adapter_class
from ucm.api import (Handle, Key, Outcome, check_keys, check_output_tokens, check_parent,
                     check_request_id, check_timeout, submit)
from ucm.buffers import block_buffer
from ucm.cache.counters import CacheCounters
from ucm.codecs.layout import KvLayout, LayoutBook
from ucm.codecs.tier import with_codec
from ucm.config.schema import UcmConfig, adapter_options, load_config
from ucm.errors import ArgumentError, ClosedError
from ucm.placement.heat import HeatTracker
from ucm.placement.engine import Placement
from ucm.placement.plans import Op, Plan, TierSpec
from ucm.tiers.executor import PlanExecutor
from ucm.placement.policies.base import check_policy, load_policy
from ucm.cache.reclaim import HeadroomReclaimer
from ucm.cache.ranges import RangeAccess
from ucm.cache.slots import SlotAccess
from ucm.cache.staging import Staging
from ucm.tiers.stack import TierStack

log = logging.getLogger(__name__)

__all__ = ["UnifiedCache", "Outcome", "Handle", "TierFactory"]

_FROM_STATUS = {Status.OK: Outcome.DONE, Status.NOT_FOUND: Outcome.MISSING, Status.NO_SPACE: Outcome.MISSING,
                Status.CORRUPT: Outcome.CORRUPT, Status.FAILED: Outcome.FAILED}

# Request ids remembered (begun, not finished yet): a bound, so that ids
# never finished (a crashed engine) cannot grow the cache's memory.
MAX_OPEN_REQUESTS = 65536


# tier_factory(index, adapter class, capacity_bytes, validated options) -> adapter
TierFactory = Callable[[int, type, int, Any], StorageAdapter]


def _default_tier(index: int, cls: type, capacity_bytes: int, options: Any) -> StorageAdapter:
    return cls(capacity_bytes=capacity_bytes, config=options)


class UnifiedCache(SlotAccess, RangeAccess, Staging, CacheCounters):
    """Blocks by key across an ordered stack of tiers (fastest first)."""

    def __init__(self, config: Union[None, str, Mapping[str, Any], UcmConfig] = None, replay: bool = False,
                 tier_factory: Optional[TierFactory] = None) -> None:
        """Opens every tier and restores what they hold. A failure on the way
        closes whatever was opened already (no arena file or thread is left
        behind) and raises.

        `replay`: driven by a trace replay that reports each block's next use
        (`Placement.record_request`), so a replay-only policy (`opt`) is
        allowed. `tier_factory(index, cls, capacity_bytes, options)` builds
        each tier (default `cls(capacity_bytes=..., config=options)`): the
        seam through which tests wrap a tier or its device to inject faults
        (ucm.adapters.faults)."""
        if isinstance(config, UcmConfig):  # built in code: load_config never checked its policy
            check_policy(config.policy.name, config.policy.options, replay=replay)
            self.config = config
        else:
            self.config = load_config(config, replay=replay)
        cfg = self.config
        self._tier_factory = tier_factory or _default_tier
        self.tier_names = [t.adapter for t in cfg.tiers]
        self.adapters: list[StorageAdapter] = []
        self.tiers: Optional[TierStack] = None
        self.accelerators = Accelerators()
        self._closed = False
        self._pool: Optional[ThreadPoolExecutor] = None
        self._reclaimer: Optional[HeadroomReclaimer] = None
        self._streamer: Optional[Any] = None  # the LayerStreamer, made by the first stream_slots
        try:
            self._open(cfg)
        except BaseException:
            self.close()
            raise

    def _open(self, cfg: UcmConfig) -> None:
        self.layouts = LayoutBook()
        for i, tier in enumerate(cfg.tiers):
            cls = load_adapter_class(tier.adapter)
            self.adapters.append(self._tier_factory(i, cls, tier.capacity, adapter_options(tier, i)))
            if tier.codec != "none":  # the codec's tier: encoded below, raw above (ucm/codecs/tier.py)
                self.adapters[i] = with_codec(self.adapters[i], tier.codec, i, self.layouts)
        self.tiers = TierStack(self.adapters, self.tier_names)
        # Every tier takes device tensors (an hbm-only cache, as the transformers front): store and load pass them.
        self._device_buffers = all(a.device_buffers for a in self.adapters)
        self.heat = HeatTracker(half_life=cfg.heat.half_life_requests, history_bytes=cfg.heat.history_bytes)
        policy = load_policy(cfg.policy.name, **cfg.policy.options)
        specs = [TierSpec(n, a.capacity_bytes) for n, a in zip(self.tier_names, self.adapters)]
        self.placement = Placement(specs, policy, self.heat, landing=self.tier_names.index(cfg.landing_tier))
        self._meta = threading.Lock()
        self.plans = PlanExecutor(self.placement, self.tiers, self._meta, self._count, self._footprint)
        self._requests: OrderedDict[str, None] = OrderedDict()
        self._staging: dict[Key, threading.Event] = {}  # block -> the staging copying it now (under _meta)
        self._requests_counted = 0  # request events the policy saw (ticks of the heat clock)
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_workers, thread_name_prefix="ucm-io")
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()
        self._shared = self.tiers.shared
        # Tiers that keep headroom: (tier, bytes kept free).
        self._headroom = [(t, int(tier.headroom * a.capacity_bytes))
                          for t, (tier, a) in enumerate(zip(cfg.tiers, self.adapters)) if tier.headroom > 0]
        self.plans.restore()
        if self._headroom:
            self._reclaimer = HeadroomReclaimer(self._reclaim_step)
        self.accelerators = Accelerators.build(cfg, self)

    # ---- queries -----------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """Length of the longest prefix of `keys` cached in any tier
        (including blocks other nodes put into a shared tier)."""
        keys = check_keys(keys)
        with self._meta:
            self._count("lookups", 1)
            n = self.placement.lookup(keys)
        if n < len(keys):
            for t in self._shared:
                try:
                    found = self.adapters[t].contains(keys[n:])
                except Exception:  # a dead cluster store is a miss
                    log.debug("shared tier %s failed in lookup", self.tier_names[t], exc_info=True)
                    continue
                m = next((i for i, f in enumerate(found) if not f), len(found))
                if m:
                    return n + m
        return n

    def locate(self, keys: Sequence[Key]) -> list[Optional[str]]:
        """The fastest tier holding each key, or None."""
        keys = check_keys(keys)
        with self._meta:
            out = [None if t is None else self.tier_names[t] for t in self.placement.locate(keys)]
        missing = [i for i, t in enumerate(out) if t is None]
        for t in self._shared:
            if not missing:
                break
            try:
                found = self.adapters[t].contains([keys[i] for i in missing])
            except Exception:
                log.debug("shared tier %s failed in locate", self.tier_names[t], exc_info=True)
                continue
            for i, f in zip(list(missing), found):
                if f:
                    out[i] = self.tier_names[t]
                    missing.remove(i)
        return out

    def register_layout(self, layout: KvLayout) -> None:
        """The KV layout of a namespace's blocks, which the codecs of the
        tiers below the landing tier encode with (ucm/codecs/layout.py).
        Idempotent; blocks of a size no layout (or more than one) was
        registered for are stored without a codec."""
        self._check_open()
        self.layouts.register(layout)

    # ---- requests ------------------------------------------------------------
    def begin_request(self, request_id: str, keys: Sequence[Key], parent: Optional[Key] = None) -> None:
        """One request over the prompt `keys`: one tick of the heat clock and
        one access per block (deepest first). Data-plane calls carrying
        `request_id` afterwards count no access; a second begin is ignored."""
        if request_id is None:
            raise ArgumentError("begin_request: request_id must be a string, got None")
        request_id = check_request_id(request_id)
        keys = check_keys(keys)
        parent = check_parent(parent)
        with self._meta:
            new = self._record_locked(keys, parent, request_id)
            if new and self.accelerators:
                p = self.placement
                seen = RequestSeen(request_id, tuple(keys), parent,
                                   tuple(None if t is None else self.tier_names[t] for t in p.locate(keys)),
                                   tuple(p.size_of(k) or 0 for k in keys))
        if new and self.accelerators:
            self.accelerators.request_seen(seen)

    def _record_locked(self, keys: Sequence[Key], parent: Optional[Key], request_id: Optional[str],
                       counted: bool = True) -> bool:
        """Counts the request's access unless `request_id` was begun already
        (or, without an id, unless the call continues one already counted:
        `counted` False, a later chunk of one client call). True if counted."""
        if request_id is None and not counted:
            return False
        if request_id is not None:
            if request_id in self._requests:
                self._requests.move_to_end(request_id)
                return False
            self._requests[request_id] = None
            if len(self._requests) > MAX_OPEN_REQUESTS:
                self._requests.popitem(last=False)
        self.placement.record_request(keys, parent=parent)
        self._requests_counted += 1
        return True

    # ---- operations --------------------------------------------------------
    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None,
              request_id: Optional[str] = None) -> Handle:
        """Stores consecutive blocks of one prompt (keys[i-1] is the parent of
        keys[i]; `parent` is the parent of keys[0]). Sources must stay
        unchanged until the handle is done."""
        keys = check_keys(keys)
        views = self._views(keys, srcs, writable=False)
        parent, request_id = check_parent(parent), check_request_id(request_id)
        return self._submit(len(keys), self._store, keys, views, parent, request_id)

    def load(self, keys: Sequence[Key], dsts: Sequence[Any], request_id: Optional[str] = None) -> Handle:
        """Copies each block into its destination (sizes must match)."""
        keys = check_keys(keys)
        views = self._views(keys, dsts, writable=True)
        return self._submit(len(keys), self._load, keys, views, check_request_id(request_id))

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        """Stages blocks held below `tier` (default the landing tier) into it."""
        keys = check_keys(keys)
        target = self.placement.landing if tier is None else self._tier_index(tier)
        if target != self.placement.landing:
            raise ArgumentError(f"prefetch: blocks are staged into the landing tier "
                                f"{self.tier_names[self.placement.landing]!r}, got tier={tier!r}")
        self._check_open()
        return self._submit(len(keys), self._prefetch, keys)

    def pin(self, keys: Sequence[Key]) -> None:
        """Keeps the blocks cached until `unpin` (counted): a hit promised to
        an engine. A pinned block may leave a tier only while another tier
        holds it too, so a reader can stage a pinned prefix longer than the
        landing tier, chunk by chunk."""
        keys = check_keys(keys)
        with self._meta:
            self.placement.pin(keys)

    def unpin(self, keys: Sequence[Key]) -> None:
        keys = check_keys(keys)
        with self._meta:
            self.placement.unpin(keys)

    def finish(self, keys: Sequence[Key], output_tokens: int, request_id: Optional[str] = None) -> None:
        """Hint: the request whose prompt has the blocks `keys` finished after
        generating `output_tokens` tokens. Placement learns from it which
        kind of job's prompts come back (ucm/placement/policies/reuse.py); moves nothing.
        Forgets `request_id`."""
        keys = check_keys(keys)
        check_output_tokens(output_tokens)
        request_id = check_request_id(request_id)
        with self._meta:
            self.placement.finish_request(keys, output_tokens)
            if request_id is not None:
                self._requests.pop(request_id, None)
        self._count("finished_requests")
        if self.accelerators:
            self.accelerators.request_finished(RequestFinished(request_id, tuple(keys), output_tokens))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Makes the tiers' headroom, then waits until buffered writes of
        every tier are on their medium."""
        timeout_s = check_timeout(timeout_s, "flush: timeout_s")
        if self._reclaimer is not None:
            self._reclaimer.run_now()
        return self.tiers.flush(timeout_s)

    def watch_keys(self, on_add: Callable[[Key], None], on_remove: Callable[[Key], None]) -> None:
        """Mirrors the set of cached keys that `lookup` sees (blocks in shared
        tiers put there by other nodes excepted): on_add for every key now and
        on every arrival, on_remove on every departure, called under the
        cache's metadata lock (they must be quick and must not call back)."""
        with self._meta:
            self.placement.watch(on_add, on_remove)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.accelerators.close()
        if self._streamer is not None:
            self._streamer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._reclaimer is not None:
            self._reclaimer.close()
        if self.tiers is not None:
            self.tiers.close()
        else:  # the TierStack was not built yet: close what was opened
            for a in self.adapters:
                try:
                    a.close()
                except Exception:  # closing the rest matters more
                    log.exception("closing tier %s failed", a.name)

    def __enter__(self) -> "UnifiedCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------

    def _tier_index(self, name: str) -> int:
        if name not in self.tier_names:
            raise ArgumentError(f"unknown tier {name!r}; configured: {self.tier_names}")
        return self.tier_names.index(name)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("UnifiedCache used after close()")

    def _views(self, keys: Sequence[Key], bufs: Sequence[Any], writable: bool) -> list[memoryview]:
        self._check_open()
        if len(keys) != len(bufs):
            raise ArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        device_ok = self._device_buffers
        views = [block_buffer(b, writable, "destination" if writable else "source", device_ok) for b in bufs]
        for v in views:
            if len(v) == 0:
                raise ArgumentError("buffers must not be empty")
        return views

    def _submit(self, n: int, fn: Any, *args: Any) -> Handle:
        return submit(self._pool, n, fn, *args,
                      on_error=lambda exc: log.error("ucm: %s failed", getattr(fn, "__name__", fn),
                                                     exc_info=exc))

    def _footprint(self, size: int) -> int:
        return self.adapters[self.placement.landing].footprint_bytes(size)

    def _store(self, keys: list[Key], views: list[memoryview], parent: Optional[Key],
               request_id: Optional[str] = None, filled: Optional[list[bool]] = None) -> list[Outcome]:
        """The whole run planned under one hold of `_meta` (`insert_run`:
        stopping at the first refusal), then executed without it.
        `filled[i]` False: views[i] holds no bytes (the caller skipped a
        block it saw cached); the run stops before such a block unless it is
        still cached when the run is planned."""
        p = self.placement
        with self._meta:
            self._record_locked(keys, parent, request_id)
            n = len(keys)
            if filled is not None:
                n = next((i for i, f in enumerate(filled) if not f and not p.contains(keys[i])), n)
            run = p.insert_run(keys[:n], parent, [self._footprint(len(v)) for v in views[:n]])
            ticket = self.plans.admit(run.plan)
        placed = run.placed[:run.stop]
        self.plans.run(ticket, dict(zip(keys, views)))
        out: list[Outcome] = []
        with self._meta:
            for i, key in enumerate(keys):
                if i < len(placed) and (not out or out[-1] is Outcome.DONE) and p.contains(key):
                    out.append(Outcome.DONE)
                else:
                    out.append(Outcome.MISSING)
            p.touch([k for k, o in zip(keys, out) if o is Outcome.DONE])
        new = [i for i, o in enumerate(out) if o is Outcome.DONE and placed[i]]
        self._count("stored_blocks", len(new))
        self._count("bytes_stored", sum(len(views[i]) for i in new))
        if new and self.accelerators:
            self.accelerators.blocks_stored(BlocksStored(
                tuple(keys[i] for i in new), tuple(len(views[i]) for i in new),
                self.tier_names[p.landing], request_id))
        if any(o is Outcome.MISSING for o in out):
            self._count("store_refused", 1)
        self.plans.drain_dropped()
        self._wake_reclaim()
        return out

    def _load(self, keys: list[Key], views: list[memoryview], request_id: Optional[str] = None) -> list[Outcome]:
        out: list[Optional[Outcome]] = [None] * len(keys)
        served: list[Optional[int]] = [None] * len(keys)  # the tier each block came from
        by_tier: dict[int, list[int]] = {}
        self.plans.adopt_shared(keys, range(len(keys)))
        with self._meta:
            self._record_locked(keys, None, request_id)
            for i, k in enumerate(keys):
                t = self.placement.where(k)
                if t is None:
                    out[i] = Outcome.MISSING
                else:
                    by_tier.setdefault(t, []).append(i)
            held = [keys[i] for idx in by_tier.values() for i in idx]
            self.placement.hold(held)
        promote: list[int] = []
        bad: list[tuple[Key, int]] = []
        try:
            for t, idx in sorted(by_tier.items()):
                try:
                    statuses = self.adapters[t].get([keys[i] for i in idx], [views[i] for i in idx])
                except Exception:
                    log.exception("ucm: reading %d blocks from tier %s failed", len(idx), self.tier_names[t])
                    statuses = [Status.FAILED] * len(idx)
                for i, st in zip(idx, statuses):
                    src: Optional[int] = t
                    if st is Status.NOT_FOUND:  # moved by a concurrent demotion: look everywhere
                        st, src = self.tiers.get_anywhere(keys[i], views[i], skip=t)
                    out[i] = _FROM_STATUS[st]
                    served[i] = src if st is Status.OK else None
                    if st is Status.OK and src is not None and src > self.placement.landing:
                        promote.append(i)
                    elif st in (Status.CORRUPT, Status.FAILED) and src is not None:
                        bad.append((keys[i], src))  # the tier whose copy was bad
        finally:
            with self._meta:
                self.placement.unhold(held)
        for key, t in bad:
            self.plans.forget(key, t)
        if promote:
            plan: Plan = []
            with self._meta:
                for i in promote:
                    plan.extend(self.placement.promote(keys[i]).plan)
                ticket = self.plans.admit(plan)
            self.plans.run(ticket, {keys[i]: views[i] for i in promote})
        with self._meta:
            self.placement.touch([k for k, o in zip(keys, out) if o is Outcome.DONE])
        done = [o if o is not None else Outcome.FAILED for o in out]
        self._count_served(self.tier_names[t] for t, o in zip(served, done) if o is Outcome.DONE and t is not None)
        n_ok = sum(o is Outcome.DONE for o in done)
        self._count("loaded_blocks", n_ok)
        self._count("bytes_loaded", sum(len(v) for v, o in zip(views, done) if o is Outcome.DONE))
        self._count("missing_blocks", sum(o is Outcome.MISSING for o in done))
        self._count("corrupt", sum(o is Outcome.CORRUPT for o in done))
        self._count("failed", sum(o is Outcome.FAILED for o in done))
        self.plans.drain_dropped()
        if self.accelerators:
            self.accelerators.blocks_loaded(BlocksLoaded(
                tuple(keys), tuple(done), tuple(None if t is None else self.tier_names[t] for t in served),
                request_id))
        return done

    def _wake_reclaim(self) -> None:
        if self._reclaimer is not None:
            self._reclaimer.wake()

    def _reclaim_step(self) -> bool:
        """One round of headroom: up to 4 victims per tier short of its
        headroom, planned under `_meta` and demoted without it. True when
        something was evicted (the reclaimer calls again)."""
        did = False
        for t, free in self._headroom:
            if self._closed:
                return False
            with self._meta:
                plan = self.placement.reclaim(t, free, max_victims=4)
                ticket = self.plans.admit(plan) if plan else None
            if ticket is not None:
                did = True
                self._count("headroom_evictions", sum(s.src == t and s.op in (Op.MOVE, Op.DROP) for s in plan))
                self.plans.run(ticket, {})
        self.plans.drain_dropped()
        return did

