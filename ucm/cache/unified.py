"""UnifiedCache: the one API (ucm.api.CacheAPI) over a stack of tiers.

`lookup`, `locate`, batched asynchronous `load` / `store` / `prefetch`
returning Handles with one Outcome per block, `pin` / `unpin`, `stats`, the
request events (`begin_request`, `request_id`) and the placement hint
`finish`; the slot API (zero-copy `write_slots` / `read_slots`, the
`reserve` / `commit` / `abort`, `acquire` / `release` the service serves to
other processes, and streamed loads) and range reads.

Layers. `ucm.placement` decides (admission, eviction, demotion, promotion)
with the configured policy and returns Plans; `ucm.tiers.executor.
PlanExecutor` admits them to `ucm.tiers.stack.TierStack`, which runs them
against the adapters, and settles failed steps. This class opens the tiers
and builds the parts, each an object acting on one CacheCore (the shared
state, ucm/cache/core.py): BlockIO (store, load), Stager (prefetch and
reader's staging), SlotAccess (slots and streams), RangeReader (range
reads) and the HeadroomReclaimer; it checks arguments and hands work to them.

Threads. Any method may be called from any thread. Loads, stores and
prefetches run on a pool of `io_workers` threads. One lock, the core's
`meta`, guards the placement metadata and the request ids; it is held only
to plan and to reconcile, never across an adapter's I/O (the TierStack
keeps each key's steps in planning order instead; see ucm/tiers/stack.py).
Blocks being read, staged or reserved are held (`hold`), so they are never
victims meanwhile. Lock order: `meta`, then the TierStack's order lock,
then an adapter's own lock (a slab arena is asked for victims under
`meta`); the counters' lock is a leaf.

Faults. Nothing on the data path raises for a cache fault: a missing file, a
bad checksum, a failed write or a full medium is an Outcome (MISSING,
CORRUPT, FAILED) and the block is forgotten where it was bad.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ucm.accelerators.base import RequestFinished, RequestSeen
from ucm.accelerators.chain import Accelerators
from ucm.adapters.base import SharedSlots, StorageAdapter, load_adapter_class
from ucm.api import (Handle, Key, Outcome, RangeRead, SlotFn, check_blocks, check_keys, check_output_tokens,
                     check_parent, check_request_id, check_timeout, submit)
from ucm.buffers import block_buffer
from ucm.cache.blocks import BlockIO
from ucm.cache.catalog import BlockCatalog
from ucm.cache.catalog_log import DescriptionLog
from ucm.cache.core import CacheCore
from ucm.cache.counters import Counters
from ucm.cache.ranges import RangeReader
from ucm.cache.reclaim import HeadroomReclaimer
from ucm.cache.slots import SlotAccess
from ucm.cache.staging import Stager
from ucm.cache.write_through import WriteThrough
from ucm.codecs.layout import KvLayout, LayoutBook
from ucm.codecs.tier import with_codec
from ucm.config.schema import UcmConfig, adapter_options, load_config
from ucm.errors import ArgumentError, ClosedError, ConfigError
from ucm.placement.factory import make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.plans import TierSpec
from ucm.placement.policies.base import check_policy, load_policy
from ucm.tiers.executor import PlanExecutor
from ucm.tiers.stack import TierStack

log = logging.getLogger(__name__)

__all__ = ["UnifiedCache", "Outcome", "Handle", "TierFactory"]

# tier_factory(index, adapter class, capacity_bytes, validated options) -> adapter
TierFactory = Callable[[int, type, int, Any], StorageAdapter]


def _shared_adapters() -> list[str]:
    """The installed adapters of tiers other nodes read."""
    from ucm.adapters.base import adapter_names

    out = []
    for name in adapter_names():
        try:
            if load_adapter_class(name).shared:
                out.append(name)
        except Exception:  # an adapter whose package is broken is not offered
            continue
    return out


def _default_tier(index: int, cls: type, capacity_bytes: int, options: Any) -> StorageAdapter:
    return cls(capacity_bytes=capacity_bytes, config=options)


class UnifiedCache:
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
        self.core: Optional[CacheCore] = None
        self._closed = False
        self._pool: Optional[ThreadPoolExecutor] = None
        self._slots: Optional[SlotAccess] = None
        self._reclaimer: Optional[HeadroomReclaimer] = None
        self._write_through: Optional[WriteThrough] = None
        self.catalog: Optional[BlockCatalog] = None
        try:
            self._open(cfg)
        except BaseException:
            self.close()
            raise

    def _open(self, cfg: UcmConfig) -> None:
        self.layouts = LayoutBook()
        media = {}
        for i, tier in enumerate(cfg.tiers):
            cls = load_adapter_class(tier.adapter)
            if tier.write_through and not cls.shared:
                raise ConfigError(f"tiers.{i}.write_through: only a tier other nodes read (a cluster store: "
                                  f"{', '.join(_shared_adapters())}) takes it, got {tier.adapter!r}")
            if cls.kv_medium:
                media[tier.adapter] = cls.kv_medium
            self.adapters.append(self._tier_factory(i, cls, tier.capacity, adapter_options(tier, i)))
            if tier.codec != "none":  # the codec's tier: encoded below, raw above (ucm/codecs/tier.py)
                self.adapters[i] = with_codec(self.adapters[i], tier.codec, i, self.layouts)
        self.tiers = TierStack(self.adapters, self.tier_names)
        # Every tier takes device tensors (an hbm-only cache, as the transformers front): store and load pass them.
        self._device_buffers = all(a.device_buffers for a in self.adapters)
        self.heat = HeatTracker(half_life=cfg.heat.half_life_requests, history_bytes=cfg.heat.history_bytes)
        policy = load_policy(cfg.policy.name, **cfg.policy.options)
        specs = [TierSpec(n, a.capacity_bytes) for n, a in zip(self.tier_names, self.adapters)]
        landing = self.tier_names.index(cfg.landing_tier)
        self.placement = make_placement(specs, policy, self.heat, landing=landing)
        meta = threading.Lock()
        counters = Counters()
        self.plans = PlanExecutor(self.placement, self.tiers, meta, counters.add, self.adapters[landing].footprint_bytes)
        core = self.core = CacheCore(cfg, self.tier_names, self.adapters, self.tiers, self.layouts, self.heat,
                                     self.placement, meta, self.plans, counters)
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_workers, thread_name_prefix="ucm-io")
        self._blocks = BlockIO(core)
        self._stager = Stager(core)
        self._slots = SlotAccess(core, self._blocks, self._stager)
        self._ranges = RangeReader(core)
        self.plans.restore()
        # Tiers that keep headroom: (tier, bytes kept free).
        headroom = [(t, int(tier.headroom * a.capacity_bytes))
                    for t, (tier, a) in enumerate(zip(cfg.tiers, self.adapters)) if tier.headroom > 0]
        if headroom:
            self._reclaimer = HeadroomReclaimer(core, headroom)
            core.wake_reclaim = self._reclaimer.wake
        through = [t for t, tier in enumerate(cfg.tiers) if tier.write_through]
        if through:
            self._write_through = WriteThrough(core, through)
            core.write_through = self._write_through.submit
        self.accelerators = core.accelerators = Accelerators.build(cfg, self)
        ev = cfg.events
        self.catalog = (BlockCatalog(self.locate, media, max_blocks=ev.max_blocks, journal=ev.journal,
                                     log=DescriptionLog.open(ev.path) if ev.path else None)
                        if ev.enabled else None)

    # ---- queries -----------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """Length of the longest prefix of `keys` cached in any tier
        (including blocks other nodes put into a shared tier)."""
        keys = check_keys(keys)
        with self.core.meta:
            self.core.counters.add("lookups", 1)
            n = self.placement.lookup(keys)
        if n < len(keys):
            for t in self.core.shared:
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
        with self.core.meta:
            out = [None if t is None else self.tier_names[t] for t in self.placement.locate(keys)]
        missing = [i for i, t in enumerate(out) if t is None]
        for t in self.core.shared:
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
        with self.core.meta:
            new = self.core.record_locked(keys, parent, request_id)
            if new and self.accelerators:
                p = self.placement
                seen = RequestSeen(request_id, tuple(keys), parent,
                                   tuple(None if t is None else self.tier_names[t] for t in p.locate(keys)),
                                   tuple(p.size_of(k) or 0 for k in keys))
        if new and self.accelerators:
            self.accelerators.request_seen(seen)

    # ---- operations --------------------------------------------------------
    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None,
              request_id: Optional[str] = None) -> Handle:
        """Stores consecutive blocks of one prompt (keys[i-1] is the parent of
        keys[i]; `parent` is the parent of keys[0]). Sources must stay
        unchanged until the handle is done."""
        keys = check_keys(keys)
        views = self._views(keys, srcs, writable=False)
        parent, request_id = check_parent(parent), check_request_id(request_id)
        return self._submit(len(keys), self._blocks.store, keys, views, parent, request_id)

    def load(self, keys: Sequence[Key], dsts: Sequence[Any], request_id: Optional[str] = None) -> Handle:
        """Copies each block into its destination (sizes must match)."""
        keys = check_keys(keys)
        views = self._views(keys, dsts, writable=True)
        return self._submit(len(keys), self._blocks.load, keys, views, check_request_id(request_id))

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        """Stages blocks held below `tier` (default the landing tier) into it."""
        keys = check_keys(keys)
        target = self.placement.landing if tier is None else self.core.tier_index(tier)
        if target != self.placement.landing:
            raise ArgumentError(f"prefetch: blocks are staged into the landing tier "
                                f"{self.tier_names[self.placement.landing]!r}, got tier={tier!r}")
        self._check_open()
        return self._submit(len(keys), self._stager.prefetch, keys)

    def pin(self, keys: Sequence[Key]) -> None:
        """Keeps the blocks cached until `unpin` (counted): a hit promised to
        an engine. A pinned block may leave a tier only while another tier
        holds it too, so a reader can stage a pinned prefix longer than the
        landing tier, chunk by chunk."""
        keys = check_keys(keys)
        with self.core.meta:
            self.placement.pin(keys)

    def unpin(self, keys: Sequence[Key]) -> None:
        keys = check_keys(keys)
        with self.core.meta:
            self.placement.unpin(keys)

    def finish(self, keys: Sequence[Key], output_tokens: int, request_id: Optional[str] = None) -> None:
        """Hint: the request whose prompt has the blocks `keys` finished after
        generating `output_tokens` tokens. Placement learns from it which
        kind of job's prompts come back (ucm/placement/policies/reuse.py); moves nothing.
        Forgets `request_id`."""
        keys = check_keys(keys)
        check_output_tokens(output_tokens)
        request_id = check_request_id(request_id)
        with self.core.meta:
            self.placement.finish_request(keys, output_tokens)
            if request_id is not None:
                self.core.forget_request_locked(request_id)
        self.core.counters.add("finished_requests")
        if self.accelerators:
            self.accelerators.request_finished(RequestFinished(request_id, tuple(keys), output_tokens))

    # ---- the block catalog (KV events) ---------------------------------------
    def describe(self, blocks: Sequence[Any]) -> None:
        """Descriptions of blocks an engine stores, for the KV events
        (ucm.cache.catalog.check_blocks: [key, parent, tokens, extra])."""
        blocks = check_blocks(blocks)
        if self.catalog is not None:
            self.catalog.describe(blocks)

    def events(self, since: int, epoch: Optional[int], limit: int = 256) -> dict:
        """The catalog's changes after `since` (BlockCatalog.events); with
        `events.enabled` off, never any."""
        if self.catalog is None:
            return {"epoch": 0, "next": 0, "events": [], "reset": False}
        return self.catalog.events(int(since), epoch, max(1, min(int(limit), 4096)))

    def holdings(self, offset: int, limit: int = 256) -> dict:
        """The held described blocks from `offset` (BlockCatalog.holdings)."""
        if self.catalog is None:
            return {"blocks": [], "next_offset": 0, "done": True}
        return self.catalog.holdings(max(0, int(offset)), max(1, min(int(limit), 4096)))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Makes the tiers' headroom, waits for the write-through copies of
        the blocks stored so far, then until buffered writes of every tier
        are on their medium."""
        timeout_s = check_timeout(timeout_s, "flush: timeout_s")
        if self._reclaimer is not None:
            self._reclaimer.run_now()
        if self._write_through is not None and not self._write_through.wait_idle(timeout_s):
            return False
        return self.tiers.flush(timeout_s)

    def watch_keys(self, on_add: Callable[[Key], None], on_remove: Callable[[Key], None]) -> None:
        """Mirrors the set of cached keys that `lookup` sees (blocks in shared
        tiers put there by other nodes excepted): on_add for every key now and
        on every arrival, on_remove on every departure, called under the
        cache's metadata lock (they must be quick and must not call back)."""
        with self.core.meta:
            self.placement.watch(on_add, on_remove)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.core is not None:
            self.core.mark_closed()
        self.accelerators.close()
        if self.catalog is not None:
            self.catalog.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._slots is not None:
            self._slots.close()
        if self._reclaimer is not None:
            self._reclaimer.close()
        if self._write_through is not None:
            self._write_through.close()
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

    # ---- the slot API and range reads (ucm/cache/slots.py, ucm/cache/ranges.py) -------
    def shared_arena(self) -> Optional[SharedSlots]:
        """The landing tier when it declares shared slots, else None."""
        return self._slots.shared_arena()

    def reserve(self, keys: Sequence[Key], sizes: Sequence[int], parent: Optional[Key] = None,
                request_id: Optional[str] = None, counted: bool = True) -> list[Union[None, bool, memoryview]]:
        return self._slots.reserve(keys, sizes, parent, request_id, counted)

    def commit(self, keys: Sequence[Key]) -> list[bool]:
        return self._slots.commit(keys)

    def abort(self, keys: Sequence[Key]) -> None:
        self._slots.abort(keys)

    def acquire(self, keys: Sequence[Key], request_id: Optional[str] = None, counted: bool = True) -> list[Any]:
        return self._slots.acquire(keys, request_id, counted)

    def release(self, leases: Sequence[Any]) -> None:
        self._slots.release(leases)

    def write_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                    parent: Optional[Key] = None, request_id: Optional[str] = None) -> list[Outcome]:
        return self._slots.write_slots(keys, sizes, fill, parent, request_id)

    def read_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                   request_id: Optional[str] = None) -> list[Outcome]:
        return self._slots.read_slots(keys, sizes, fill, request_id)

    def stream_slots(self, keys: Sequence[Key], sizes: Sequence[int], layers: int,
                     request_id: Optional[str] = None, words: Optional[memoryview] = None,
                     on_done: Optional[Any] = None) -> Any:
        return self._slots.stream_slots(keys, sizes, layers, request_id, words, on_done)

    def read_ranges(self, keys: Sequence[Key], offsets: Sequence[Sequence[int]], dsts: Sequence[Sequence[Any]],
                    request_id: Optional[str] = None) -> list[RangeRead]:
        return self._ranges.read_ranges(keys, offsets, dsts, request_id)

    def stats(self) -> dict[str, Any]:
        """The cache's figures (ucm.api.CacheAPI.stats): per tier the
        placement's counters, the adapter's own stats, `range_bytes` and
        `served_blocks`; the whole-cache counts; requests and accelerators."""
        core = self.core
        with core.meta:
            p = self.placement
            tiers = {}
            for t, name in enumerate(self.tier_names):
                c = p.counters(t)
                tiers[name] = {
                    "capacity_bytes": p.capacity_bytes(t), "used_bytes": p.used_bytes(t), "blocks": p.blocks(t),
                    "hits": c.hits, "inserts": c.inserts, "evictions": c.evictions,
                    "demotions_in": c.demotions_in, "promotions_in": c.promotions_in,
                    "bytes_written": c.bytes_written,
                }
            open_requests, requests = core.request_figures_locked()
        counts = core.counters.snapshot()
        counts["corrupt"] += self.tiers.corrupt
        for name, a in zip(self.tier_names, self.adapters):
            tiers[name]["adapter"] = a.stats()
            tiers[name]["range_bytes"] = counts.pop(f"range_bytes.{name}", 0)
            tiers[name]["served_blocks"] = counts.pop(f"served_blocks.{name}", 0)
        return {"tiers": tiers, **counts, "requests": requests, "open_requests": open_requests,
                "accelerators": self.accelerators.stats(),
                "catalog": self.catalog.stats() if self.catalog is not None else None}

    # ---- internals ---------------------------------------------------------

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
