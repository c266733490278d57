"""UnifiedCache: the one API over every tier.

`lookup`, `locate`, batched asynchronous `load` / `store` / `prefetch`
returning Handles with one Outcome per block, `pin` / `unpin`, `stats`,
and the placement hint `finish` (a request's output length).
Placement decisions (admission, eviction, demotion, promotion) are made by
`ucm.placement.Placement` with the configured policy and HeatTracker; this
class executes the resulting plans against the adapters.

Threads. Any method may be called from any thread. Loads, stores and
prefetches run on a pool of `io_workers` threads. Two locks:
`_meta` guards the placement metadata (held briefly, never across I/O);
`_mutate` serialises plan execution, so steps reach the adapters in the
order they were planned (lock order: `_mutate`, then `_meta`, then an
adapter's own lock: `_make_slot` asks the dram arena for victims under
`_meta`). Loads copy without `_mutate` under holds (`Placement.hold`), so a block being read is
never evicted.

Faults. Nothing on the data path raises for a cache fault: a missing file, a
bad checksum, a failed write or a full medium is an Outcome (MISSING,
CORRUPT, FAILED) and the block is forgotten where it was bad.
"""
from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ucm.adapters.base import Status, StorageAdapter, load_adapter_class
from ucm.buffers import byte_view
from ucm.config import UcmConfig, adapter_options, load_config
from ucm.errors import ArgumentError, ClosedError
from ucm.heat import HeatTracker, Key
from ucm.placement import Op, Placement, Plan, TierSpec
from ucm.policy.base import check_policy, load_policy

log = logging.getLogger(__name__)


def check_keys(keys: Any) -> Sequence[Key]:
    """`keys` as a list or tuple of 16-byte block keys, else ArgumentError
    (a single key passed where a sequence belongs is the usual slip)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise ArgumentError(f"keys must be a sequence of 16-byte bytes objects, got one "
                            f"{type(keys).__name__} object; wrap a single key in a list")
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or len(k) != 16:
            raise ArgumentError(f"keys must be 16-byte bytes objects, got {k!r:.40}")
    return keys


def check_output_tokens(value: Any) -> int:
    """`finish`'s output_tokens: an int >= 0, else ArgumentError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ArgumentError(f"finish: output_tokens must be an integer >= 0, got {value!r}")
    return value


class Outcome(enum.Enum):
    DONE = "done"
    MISSING = "missing"  # not cached (or refused: no room, not admitted)
    CORRUPT = "corrupt"  # bytes came back bad; the block was dropped
    FAILED = "failed"  # I/O error or a dead medium


_FROM_STATUS = {Status.OK: Outcome.DONE, Status.NOT_FOUND: Outcome.MISSING, Status.NO_SPACE: Outcome.MISSING,
                Status.CORRUPT: Outcome.CORRUPT, Status.FAILED: Outcome.FAILED}


class Handle:
    """Completion of one batched operation: one Outcome per block."""

    def __init__(self, n: int) -> None:
        self._results: list[Optional[Outcome]] = [None] * n
        self._event = threading.Event()
        if n == 0:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[list[Outcome]]:
        """The outcomes once done; None if `timeout_s` passed first."""
        if not self._event.wait(timeout_s):
            return None
        return list(self._results)  # type: ignore[arg-type]

    @property
    def results(self) -> list[Optional[Outcome]]:
        """Outcomes so far (None for blocks still pending)."""
        return list(self._results)

    @property
    def ok(self) -> bool:
        return self.done() and all(r is Outcome.DONE for r in self._results)

    def _finish(self, results: Sequence[Outcome]) -> None:
        self._results = list(results)
        self._event.set()


# tier_factory(index, adapter class, capacity_bytes, validated options) -> adapter
TierFactory = Callable[[int, type, int, Any], StorageAdapter]


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
        self._closed = False
        self._pool: Optional[ThreadPoolExecutor] = None
        self._reclaimer: Optional[threading.Thread] = None
        self._reclaim_wake = threading.Event()
        try:
            self._open(cfg)
        except BaseException:
            self.close()
            raise

    def _open(self, cfg: UcmConfig) -> None:
        for i, tier in enumerate(cfg.tiers):
            cls = load_adapter_class(tier.adapter)
            self.adapters.append(self._tier_factory(i, cls, tier.capacity, adapter_options(tier, i)))
        self.heat = HeatTracker(half_life=cfg.heat.half_life_requests)
        policy = load_policy(cfg.policy.name, **cfg.policy.options)
        specs = [TierSpec(n, a.capacity_bytes) for n, a in zip(self.tier_names, self.adapters)]
        self.placement = Placement(specs, policy, self.heat, landing=self.tier_names.index(cfg.landing_tier))
        self._meta = threading.Lock()
        self._mutate = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=cfg.io_workers, thread_name_prefix="ucm-io")
        self._counts: Counter = Counter()
        self._counts_lock = threading.Lock()
        self._shared = [t for t, a in enumerate(self.adapters) if a.shared]
        # Tiers that keep headroom: (tier, bytes kept free), made by a
        # background thread woken after every operation that adds blocks.
        self._headroom = [(t, int(tier.headroom * a.capacity_bytes))
                          for t, (tier, a) in enumerate(zip(cfg.tiers, self.adapters)) if tier.headroom > 0]
        self._restore()
        if self._headroom:
            self._reclaimer = threading.Thread(target=self._reclaim_loop, name="ucm-reclaim", daemon=True)
            self._reclaimer.start()

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
            found = self.adapters[t].contains([keys[i] for i in missing])
            for i, f in zip(list(missing), found):
                if f:
                    out[i] = self.tier_names[t]
                    missing.remove(i)
        return out

    # ---- operations --------------------------------------------------------
    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None) -> Handle:
        """Stores consecutive blocks of one prompt (keys[i-1] is the parent of
        keys[i]; `parent` is the parent of keys[0]). Sources must stay
        unchanged until the handle is done."""
        views = self._views(keys, srcs, writable=False)
        return self._submit(len(keys), self._store, list(keys), views, parent)

    def load(self, keys: Sequence[Key], dsts: Sequence[Any]) -> Handle:
        """Copies each block into its destination (sizes must match)."""
        views = self._views(keys, dsts, writable=True)
        return self._submit(len(keys), self._load, list(keys), views)

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        """Stages blocks held below `tier` (default the landing tier) into it."""
        keys = check_keys(keys)
        target = self.placement.landing if tier is None else self._tier_index(tier)
        if target != self.placement.landing:
            raise ArgumentError(f"prefetch: blocks are staged into the landing tier "
                                f"{self.tier_names[self.placement.landing]!r}, got tier={tier!r}")
        return self._submit(len(keys), self._prefetch, list(keys))

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

    def finish(self, keys: Sequence[Key], output_tokens: int) -> None:
        """Hint: the request whose prompt has the blocks `keys` finished after
        generating `output_tokens` tokens. Placement learns from it which
        kind of job's prompts come back (ucm/reuse.py); moves nothing."""
        keys = check_keys(keys)
        check_output_tokens(output_tokens)
        with self._meta:
            self.placement.finish_request(keys, output_tokens)
        self._count("finished_requests")

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Makes the tiers' headroom, then waits until buffered writes of
        every tier are on their medium."""
        self._reclaim()
        ok = True
        for a in self.adapters:
            f = getattr(a, "flush", None)
            if f is not None:
                ok = f(timeout_s=timeout_s) and ok
        return ok

    def stats(self) -> dict[str, Any]:
        with self._meta:
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
            with self._counts_lock:
                counts = dict(self._counts)
        for name, a in zip(self.tier_names, self.adapters):
            tiers[name]["adapter"] = a.stats()
        for k in ("lookups", "loaded_blocks", "missing_blocks", "corrupt", "failed", "stored_blocks",
                  "store_refused", "bytes_loaded", "bytes_stored", "headroom_evictions",
                  "finished_requests", "slot_evictions"):
            counts.setdefault(k, 0)
        return {"tiers": tiers, **counts}

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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._reclaimer is not None:
            self._reclaim_wake.set()
            self._reclaimer.join()
        for a in self.adapters:
            try:
                a.close()
            except Exception:  # closing the rest matters more
                log.exception("closing tier %s failed", a.name)

    def __enter__(self) -> "UnifiedCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- two-phase access to the shared-memory landing tier ----------------
    # Used by the service: engine processes copy into and out of the dram
    # arena themselves, the cache only hands out slots.
    def shared_arena(self):
        """The landing tier's shared-memory adapter (has reserve/commit/
        abort/lease/release and `segment_path`), or None."""
        a = self.adapters[self.placement.landing]
        return a if hasattr(a, "reserve") and hasattr(a, "segment_path") else None

    def reserve(self, keys: Sequence[Key], sizes: Sequence[int],
                parent: Optional[Key] = None) -> list[Union[None, bool, memoryview]]:
        """Places consecutive blocks like `store` but hands back, per block, a
        writable slot view to fill and then `commit` (or `abort`); True when
        the block is already cached; None when refused (and every block
        after it, which would lack its parent)."""
        arena = self.shared_arena()
        if arena is None:
            raise ArgumentError(f"reserve needs a shared-memory landing tier; landing is "
                                f"{self.tier_names[self.placement.landing]!r}")
        keys = check_keys(keys)
        if len(keys) != len(sizes):
            raise ArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
        landing = self.placement.landing
        out: list[Union[None, bool, memoryview]] = []
        with self._meta:
            self.placement.record_request(keys, parent=parent)
        for i, key in enumerate(keys):
            if out and out[-1] is None:
                out.append(None)
                continue
            par = keys[i - 1] if i else parent
            with self._mutate:
                with self._meta:
                    d = self.placement.insert(key, par, self._footprint(sizes[i]))
                    present = not d.placed and self.placement.contains(key)
                steps = [s for s in d.plan if s.op is not Op.WRITE]
                self._run_plan(steps, {})
                view = None
                if d.placed:
                    view = self._reserve_slot(landing, key, sizes[i])
                    if view is None:
                        with self._meta:
                            undo = self.placement.remove(key, landing)
                        self._run_plan(undo, {})
                        self._count("store_refused", 1)
                with self._meta:
                    if view is not None:
                        self.placement.hold([key])  # not a victim until committed or aborted
                    if view is not None or present:
                        self.placement.touch([key])
            out.append(True if present else view)
        return out

    def commit(self, keys: Sequence[Key]) -> list[bool]:
        """Makes filled slots visible; False for a key with no reservation
        (it was taken back meanwhile)."""
        keys = check_keys(keys)
        arena = self.shared_arena()
        out = []
        for key in keys:
            size = arena.slot_offset(key)
            ok = arena.commit(key)
            if ok:
                with self._meta:
                    self.placement.unhold([key])
                self._count("stored_blocks", 1)
                self._count("bytes_stored", size[1])
            out.append(ok)
        self._wake_reclaim()
        return out

    def abort(self, keys: Sequence[Key]) -> None:
        """Gives back reserved slots that will not be filled."""
        keys = check_keys(keys)
        arena = self.shared_arena()
        landing = self.placement.landing
        for key in keys:
            if arena.slot_offset(key) is None:
                continue  # not reserved (committed or never placed)
            arena.abort(key)
            with self._mutate:
                with self._meta:
                    self.placement.unhold([key])
                    undo = self.placement.remove(key, landing) if not arena.contains([key])[0] else []
                self._run_plan(undo, {})

    def acquire(self, keys: Sequence[Key]) -> list[Any]:
        """Leases each block's slot in the shared-memory landing tier for
        reading, staging blocks held only below it first (synchronously).
        Per key: a Lease (its `view` is the blob) or None on a miss. Give
        every lease back with `release`."""
        arena = self.shared_arena()
        if arena is None:
            raise ArgumentError("acquire needs a shared-memory landing tier")
        keys = check_keys(keys)
        out: list[Any] = []
        with self._meta:
            self.placement.record_request(keys)
        leases = [arena.lease(key) for key in keys]
        staging = any(le is None for le in leases)
        if staging:
            for i, key in enumerate(keys):
                if leases[i] is None and self._shared and not self.placement.contains(key):
                    self._adopt_remote(key, keys[i - 1] if i else None)
            need = [i for i, le in enumerate(leases) if le is None]
            with self._mutate:  # staged blocks are leased before anything can evict them
                self._stage([keys[i] for i in need], force=True)
                for i in need:
                    leases[i] = arena.lease(keys[i])
        for lease in leases:
            out.append(lease)
            if lease is None:
                self._count("missing_blocks", 1)
            else:
                self._count("loaded_blocks", 1)
                self._count("bytes_loaded", len(lease.view))
        with self._meta:
            self.placement.touch([k for k, le in zip(keys, out) if le is not None])
        self._drain_dropped()
        if staging:
            self._wake_reclaim()
        return out

    def release(self, leases: Sequence[Any]) -> None:
        arena = self.shared_arena()
        for lease in leases:
            if lease is not None:
                arena.release(lease)

    # ---- internals ---------------------------------------------------------
    def _adopt_remote(self, key: Key, parent: Optional[Key]) -> Optional[int]:
        """Records a block found only in a shared tier (put there by another
        node) so that the usual paths can load and promote it. Returns the
        tier, or None. Caller holds no lock."""
        for t in self._shared:
            a = self.adapters[t]
            size = a.size_of(key)
            if size is None:
                continue
            with self._mutate:
                with self._meta:
                    if self.placement.contains(key):
                        return self.placement.where(key)
                    if parent is not None and not self.placement.contains(parent):
                        parent = None
                    d = self.placement.insert(key, parent, self._footprint(size), tier=t, restored=True)
                self._run_plan(d.plan, {})
            if d.placed:
                return t
        return None

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] += n

    def _tier_index(self, name: str) -> int:
        if name not in self.tier_names:
            raise ArgumentError(f"unknown tier {name!r}; configured: {self.tier_names}")
        return self.tier_names.index(name)

    def _views(self, keys: Sequence[Key], bufs: Sequence[Any], writable: bool) -> list[memoryview]:
        if self._closed:
            raise ClosedError("UnifiedCache used after close()")
        keys = check_keys(keys)
        if len(keys) != len(bufs):
            raise ArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
        views = [byte_view(b, writable=writable, what="destination" if writable else "source") for b in bufs]
        for v in views:
            if len(v) == 0:
                raise ArgumentError("buffers must not be empty")
        return views

    def _submit(self, n: int, fn: Any, *args: Any) -> Handle:
        handle = Handle(n)

        def run() -> None:
            try:
                results = fn(*args)
            except Exception:  # a bug must not hang the caller: report FAILED
                log.exception("ucm: %s failed", getattr(fn, "__name__", fn))
                results = [Outcome.FAILED] * n
            handle._finish(results)

        if n:
            self._pool.submit(run)
        return handle

    def _restore(self) -> None:
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

        for t, a in enumerate(self.adapters):
            if a.shared:
                continue  # other nodes' blocks: asked for on demand
            entries = {e.key: e for e in a.iter_entries()}
            with self._mutate:
                for e in parents_first(entries):
                    with self._meta:
                        par = e.parent if e.parent is not None and self.placement.contains(e.parent) else None
                        d = self.placement.insert(e.key, par, self._footprint(e.size_bytes), tier=t, restored=True)
                        kept = d.placed or self.placement.contains(e.key)
                    self._run_plan_locked(d.plan, {})  # takes _meta itself if a step fails
                    if not kept:
                        a.delete([e.key])

    def _footprint(self, size: int) -> int:
        return self.adapters[self.placement.landing].footprint_bytes(size)

    def _store(self, keys: list[Key], views: list[memoryview], parent: Optional[Key]) -> list[Outcome]:
        out: list[Outcome] = []
        stopped = False
        with self._meta:
            self.placement.record_request(keys, parent=parent)
        for i, key in enumerate(keys):
            if stopped:  # a child is useless without its parent
                out.append(Outcome.MISSING)
                continue
            par = keys[i - 1] if i else parent
            with self._mutate:
                with self._meta:
                    d = self.placement.insert(key, par, self._footprint(len(views[i])))
                ok = self._run_plan(d.plan, {key: views[i]}) if d.plan else True
                with self._meta:
                    placed = d.placed and ok and self.placement.contains(key)
                    present = self.placement.contains(key)
                    if placed or present:
                        self.placement.touch([key])
            if placed:
                out.append(Outcome.DONE)
                self._count("stored_blocks", 1)
                self._count("bytes_stored", len(views[i]))
            elif present:
                out.append(Outcome.DONE)  # already cached: blobs under a key never change
            else:
                out.append(Outcome.MISSING)
                self._count("store_refused", 1)
                stopped = True
        self._drain_dropped()
        self._wake_reclaim()
        return out

    def _load(self, keys: list[Key], views: list[memoryview]) -> list[Outcome]:
        out: list[Optional[Outcome]] = [None] * len(keys)
        by_tier: dict[int, list[int]] = {}
        if self._shared:
            for i, k in enumerate(keys):
                if not self.placement.contains(k):
                    self._adopt_remote(k, keys[i - 1] if i else None)
        with self._meta:
            self.placement.record_request(keys)
            for i, k in enumerate(keys):
                t = self.placement.where(k)
                if t is None:
                    out[i] = Outcome.MISSING
                else:
                    by_tier.setdefault(t, []).append(i)
            self.placement.hold([keys[i] for idx in by_tier.values() for i in idx])
        promote: list[int] = []
        try:
            for t, idx in sorted(by_tier.items()):
                statuses = self.adapters[t].get([keys[i] for i in idx], [views[i] for i in idx])
                for i, st in zip(idx, statuses):
                    if st is Status.NOT_FOUND:  # moved by a concurrent demotion: look everywhere
                        st = self._get_anywhere(keys[i], views[i], skip=t)
                    out[i] = _FROM_STATUS[st]
                    if st is Status.OK and t > self.placement.landing:
                        promote.append(i)
                    elif st in (Status.CORRUPT, Status.FAILED):
                        self._forget(keys[i], t)
        finally:
            with self._meta:
                self.placement.unhold([keys[i] for idx in by_tier.values() for i in idx])
        for i in promote:
            with self._mutate:
                with self._meta:
                    d = self.placement.promote(keys[i])
                self._run_plan(d.plan, {keys[i]: views[i]})
        with self._meta:
            self.placement.touch([k for k, o in zip(keys, out) if o is Outcome.DONE])
        done = [o if o is not None else Outcome.FAILED for o in out]
        n_ok = sum(o is Outcome.DONE for o in done)
        self._count("loaded_blocks", n_ok)
        self._count("bytes_loaded", sum(len(v) for v, o in zip(views, done) if o is Outcome.DONE))
        self._count("missing_blocks", sum(o is Outcome.MISSING for o in done))
        self._count("corrupt", sum(o is Outcome.CORRUPT for o in done))
        self._count("failed", sum(o is Outcome.FAILED for o in done))
        self._drain_dropped()
        return done

    def _get_anywhere(self, key: Key, view: memoryview, skip: int) -> Status:
        for t, a in enumerate(self.adapters):
            if t != skip:
                st = a.get([key], [view])[0]
                if st is not Status.NOT_FOUND:
                    return st
        return Status.NOT_FOUND

    def _prefetch(self, keys: list[Key]) -> list[Outcome]:
        if self._shared:
            for i, key in enumerate(keys):
                if not self.placement.contains(key):
                    self._adopt_remote(key, keys[i - 1] if i else None)
        with self._mutate:
            self._stage(keys, force=False)
            with self._meta:
                landing = self.placement.landing
                out = [Outcome.DONE if self.placement.where(k) == landing else Outcome.MISSING for k in keys]
        self._drain_dropped()
        self._wake_reclaim()
        return out

    def _stage(self, keys: Sequence[Key], force: bool) -> None:
        """Copies the blocks of `keys` held only below the landing tier up
        into it (`force`: without asking the policy, for a reader). Every
        promotion is planned first, so that the evictions they need run
        before, and the reads as one batch per source tier (in parallel on
        the adapter's I/O threads) instead of one block at a time."""
        landing = self.placement.landing
        plan: Plan = []
        staged: list[Key] = []
        with self._mutate:
            with self._meta:
                for key in keys:
                    src = self.placement.where(key)
                    if src is None or src <= landing:
                        continue
                    d = self.placement.promote(key, force=force)
                    plan.extend(d.plan)
                    if d.placed:  # later promotions must not pick it as a victim before its copy
                        self.placement.hold([key])
                        staged.append(key)
            try:
                copies = [s for s in plan if s.op is Op.COPY]
                self._run_plan_locked([s for s in plan if s.op is not Op.COPY], {})
                self._copy_batch(copies)
            finally:
                with self._meta:
                    self.placement.unhold(staged)

    def _copy_batch(self, steps: Plan) -> None:
        """COPY steps, one adapter read per source tier when the destination
        hands out slots to read into (the dram arena); others one by one."""
        groups: dict[tuple[int, int], Plan] = {}
        for step in steps:
            groups.setdefault((step.src, step.dst), []).append(step)
        for (src, dst), group in groups.items():
            a, b = self.adapters[src], self.adapters[dst]
            if getattr(b, "reserve", None) is None or getattr(a, "lease", None) is not None:
                self._run_plan_locked(group, {})
                continue
            keys, views, failed = [], [], []
            for step in group:
                size = a.size_of(step.key)
                view = self._reserve_slot(dst, step.key, size) if size is not None else None
                if view is None:
                    failed.append((step.key, Status.NOT_FOUND if size is None else Status.NO_SPACE))
                else:
                    keys.append(step.key)
                    views.append(view)
            try:
                statuses = a.get(keys, views) if keys else []
            except Exception:  # a fault is a miss; the reserved slots are given back below
                log.exception("ucm: reading %d blocks from tier %s failed", len(keys), self.tier_names[src])
                statuses = [Status.FAILED] * len(keys)
            for key, view, st in zip(keys, views, statuses):
                view.release()
                if st is Status.OK:
                    b.commit(key)
                else:
                    b.abort(key)
                    failed.append((key, st))
            for key, st in failed:
                if st is Status.CORRUPT:
                    self._count("corrupt", 1)
                with self._meta:
                    undo = self.placement.remove(key, dst)
                b.delete([key])
                self._run_plan_locked(undo, {})

    def _reserve_slot(self, t: int, key: Key, size: int) -> Optional[memoryview]:
        """Tier t's `reserve(key, size)`, made to succeed once more by
        `_make_slot` when the arena has no slot of that size. Every
        reservation of the cache goes through here. Caller holds `_mutate`,
        not `_meta`."""
        a = self.adapters[t]
        view = a.reserve(key, size)
        if view is None and self._make_slot(t, key, size):
            view = a.reserve(key, size)
        return view

    def _put_block(self, t: int, key: Key, src: Any, parent: Optional[Key]) -> Status:
        """Tier t's `put_with_parents` of one block, tried once more after
        `_make_slot` when the tier said NO_SPACE. Caller holds `_mutate`,
        not `_meta`."""
        a = self.adapters[t]
        st = a.put_with_parents([key], [src], [parent])[0]
        if st is Status.NO_SPACE and self._make_slot(t, key, len(src)):
            st = a.put_with_parents([key], [src], [parent])[0]
        return st

    def _make_slot(self, t: int, key: Key, size: int) -> bool:
        """Tier t found no slot for `key` although Placement made room by
        bytes (the freed bytes lie in extents of another size class of a
        slab arena, ucm.adapters.slab). Asks the adapter which blocks to give
        up (`victims_for`), first those Placement may evict in prefix order,
        else with parents demoted ahead of their children; evicts them
        through Placement (`evict_keys`: demoted like any victim) and runs
        that plan. True when something was evicted, so one more try is
        worth it. Caller holds `_mutate`, not `_meta`."""
        a = self.adapters[t]
        victims_for = getattr(a, "victims_for", None)
        if victims_for is None or a.contains([key])[0]:
            return False
        plan: Plan = []
        with self._meta:  # the adapter's lock is taken inside `_meta` here (a leaf lock)
            p = self.placement
            protect = p.parent_of(key)
            for relaxed in (False, True):
                def acceptable(keys: tuple[Key, ...], relaxed: bool = relaxed) -> bool:
                    return p.may_evict(t, keys, protect=protect, relaxed=relaxed)

                v = victims_for(size, acceptable)
                if v.keys:
                    plan = p.evict_keys(t, v.keys, any_one=v.any_one, protect=protect, relaxed=relaxed)
                    if plan:
                        break
        if not plan:
            return False
        self._count("slot_evictions", sum(s.src == t and s.op in (Op.MOVE, Op.DROP) for s in plan))
        self._run_plan_locked(plan, {})
        return True

    def _forget(self, key: Key, tier: int) -> None:
        with self._mutate:
            with self._meta:
                plan = self.placement.remove(key, tier)
            self.adapters[tier].delete([key])
            self._run_plan(plan, {})

    def _wake_reclaim(self) -> None:
        if self._reclaimer is not None:
            self._reclaim_wake.set()

    def _reclaim_loop(self) -> None:
        while True:
            self._reclaim_wake.wait()
            self._reclaim_wake.clear()
            if self._closed:
                return
            try:
                self._reclaim()
            except Exception:  # a failed demotion is dropped by _run_plan; never kill the thread
                log.exception("ucm: making headroom failed")

    def _reclaim(self) -> None:
        """Demotes victims until each tier with headroom has it free, a few
        at a time so that foreground operations are not held up behind a
        long run of writes."""
        for t, free in self._headroom:
            while not self._closed:
                with self._mutate:
                    with self._meta:
                        plan = self.placement.reclaim(t, free, max_victims=4)
                    if not plan:
                        break
                    self._count("headroom_evictions", sum(s.src == t and s.op in (Op.MOVE, Op.DROP) for s in plan))
                    self._run_plan_locked(plan, {})
        self._drain_dropped()

    def _drain_dropped(self) -> None:
        for t, a in enumerate(self.adapters):
            for key in a.drain_dropped():
                with self._mutate:
                    with self._meta:
                        plan = self.placement.remove(key, t)
                    self._run_plan(plan, {})

    def _run_plan(self, plan: Plan, sources: dict[Key, memoryview]) -> bool:
        """Executes plan steps in order under `_mutate` (re-entrant; the
        caller must not hold `_meta`). A step that fails is taken back out
        of the placement. Returns False if any step failed."""
        with self._mutate:
            return self._run_plan_locked(plan, sources)

    def _run_plan_locked(self, plan: Plan, sources: dict[Key, memoryview]) -> bool:
        ok = True
        for step in plan:
            if step.op is Op.DROP:
                self._delete(step.src, step.key)
                continue
            with self._meta:  # written with the bytes: a tier may keep the tree across a restart
                parent = self.placement.parent_of(step.key)
            try:
                if step.op is Op.WRITE:
                    st = self._put_block(step.dst, step.key, sources[step.key], parent)
                else:
                    st = self._transfer(step.key, step.src, step.dst, sources.get(step.key), parent)
            except Exception:  # a tier that raises is a failed step, never a slot left behind
                log.exception("ucm: %s of a block to tier %s failed", step.op.name.lower(),
                              self.tier_names[step.dst])
                st = Status.FAILED
            if step.op is Op.MOVE:
                self._delete(step.src, step.key)
            if st is not Status.OK:
                ok = False
                if st is Status.CORRUPT:
                    self._count("corrupt", 1)
                with self._meta:
                    undo = self.placement.remove(step.key, step.dst)
                self._delete(step.dst, step.key)
                self._run_plan_locked(undo, {})
        return ok

    def _delete(self, t: int, key: Key) -> None:
        """Tier t's delete of one block; a tier that raises is logged (the
        placement has already let the block go)."""
        try:
            self.adapters[t].delete([key])
        except Exception:
            log.exception("ucm: deleting a block from tier %s failed", self.tier_names[t])

    def _transfer(self, key: Key, src: int, dst: int, have: Optional[memoryview],
                  parent: Optional[Key] = None) -> Status:
        """Copies one block between tiers (through the caller's buffer when
        it already holds the bytes, else through a staging buffer); `parent`
        goes with it to the destination."""
        if have is not None:
            return self._put_block(dst, key, have, parent)
        a = self.adapters[src]
        lease = getattr(a, "lease", None)
        if lease is not None:  # zero-copy read out of a shared-memory slot
            held = lease(key)
            if held is None:
                return Status.NOT_FOUND
            try:
                return self._put_block(dst, key, held.view, parent)
            finally:
                a.release(held)
        size = a.size_of(key)
        if size is None:
            return Status.NOT_FOUND
        reserve = getattr(self.adapters[dst], "reserve", None)
        if reserve is not None:  # read straight into the destination slot
            view = self._reserve_slot(dst, key, size)
            if view is None:
                return Status.NO_SPACE
            st = a.get([key], [view])[0]
            view.release()
            if st is Status.OK:
                self.adapters[dst].commit(key)
            else:
                self.adapters[dst].abort(key)
            return st
        staging = bytearray(size)
        st = a.get([key], [staging])[0]
        return self._put_block(dst, key, staging, parent) if st is Status.OK else st
