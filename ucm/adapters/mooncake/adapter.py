"""`mooncake`: blocks in a Mooncake Store, the memory pool shared by a cluster.

The pool. A `mooncake_master` (one per cluster) keeps the object index and
hands out space; every node's client may contribute `segment_size` bytes of
its DRAM to the pool (0: use the pool, give nothing), and dedicated pool
nodes (`mooncake_client`) may add more. Data moves between a client and the
segment holding an object over the transfer engine (`protocol`: tcp here,
rdma where NICs allow). See docs/cluster.md for ports and flags.

Values. Each block is one object `header || payload` (ucm.adapters.framing)
under the key `<key_prefix><32 hex digits of the block key>`: several
deployments share one pool through different prefixes. Reads check the header
(magic, key, length, XXH3-64): foreign or damaged bytes, or bytes overwritten
under a reader whose lease ran out, are CORRUPT, never data.

Range reads. Not declared (RangeReads): the client reads whole objects
only, so `read_range` serves a range with a whole get, verified as a whole.

Zero copy. Batches go through `batch_put_from_multi_buffers` and
`batch_get_into_multi_buffers`: the header travels from/into a small slot of
the adapter's own registered scratch memory and the payload straight from/into
the caller's buffer, one object per key, one call per batch. The transfer
engine must be allowed to touch the caller's memory: on protocol tcp it reads
and writes any local memory; on rdma memory must be registered, so the owner
registers long-lived memory (the DRAM arena) with `register_memory()`, and
other buffers are copied through the registered staging area
(`staging_size`, shared by `concurrency` concurrent calls).

Space. `capacity_bytes` is this adapter's budget in the pool: it counts the
objects it stored (header included) and answers NO_SPACE past it; a pool with
no room (NO_AVAILABLE_HANDLE, a tenant quota) is NO_SPACE too. The master
evicts objects on its own (leases and soft pins expire, memory runs low): an
object this adapter stored that is found gone is a miss, leaves the budget and
is reported by `drain_dropped()`. A read whose lease ran out before its
transfer ended, or of an object another node is still writing, is a miss too.
A node that dies leaves its objects listed by the master until its
`client_ttl` runs out (seconds, or for good with a long one): a read of one
fails its transfer. When every replica of an object whose transfer failed
lives at an endpoint that refuses connections (its holder is gone; a restarted
node listens elsewhere), the reader removes the object from the pool and
answers a miss (reported by `drain_dropped()`, whoever stored it), so that
lookups stop counting it and a later put writes it again. Any other failed
transfer (a holder that accepts connections or times out) is FAILED and
leaves the object alone. A put never answers "already present" for an
object this instance found unreadable and could not remove. (This recovery
is `DeadHolderRecovery`, ucm/adapters/mooncake/recovery.py.) `iter_keys()`
returns the keys this instance stored or found present when storing, never a
scan of the pool; `contains`, `get` and `size_of` ask the master, so blocks
of other nodes are found.
A `delete` removes the object even while another reader holds a lease on it
(`force_delete`): that reader then gets a CORRUPT or missing block, not wrong
data, because every read is verified.

Faults. A background thread probes the master (a TCP connect every
`probe_interval_s`, and the client's own health check); while the master is
unreachable, or for `retry_after_s` after a call saw an RPC failure, every call
answers FAILED (reads, writes) or False/None (queries) at once without
touching the network, instead of waiting out the client's multi-second RPC
timeouts. When the master is back the client re-mounts its segment and the
tier works again (objects held only by the old master's index are misses).
If the master is down when the adapter is built, the adapter still builds,
answers misses, and completes its setup in the background once the master
answers. Nothing on the data path raises for a fault. The client's setup,
probing and registered memory are `StoreSession`
(ucm/adapters/mooncake/session.py).

The budget index (`ClusterBudget`) and the "answer at once" state
(`CircuitBreaker`) are shared with the other cluster tiers
(ucm.adapters.cluster).

Thread-safe. Lock order: `_lock` (the counters), then the budget's own
lock; the session, the recovery and the breaker each have a lock of their
own, never held while calling out, and the store client's data calls run
outside every lock. At
most `concurrency` calls move data at once (each holds one scratch area,
ucm.adapters.mooncake.scratch); more wait up to `wait_s`, then answer
FAILED. Config and error codes: ucm.adapters.mooncake.codes.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Iterator, Optional, Sequence

from ucm import _native
from ucm.adapters import framing
from ucm.adapters.base import Key, Status
from ucm.adapters.cluster import BudgetedAdapter, CircuitBreaker, ClusterBudget
from ucm.adapters.mooncake.codes import (LEASE_EXPIRED, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND,
                                         REPLICA_IS_NOT_READY, SIZE_CODES, TENANT_QUOTA_EXCEEDED, TRANSFER_FAIL,
                                         UNREACHABLE, MooncakeConfig)
from ucm.adapters.mooncake.recovery import DeadHolderRecovery
from ucm.adapters.mooncake.scratch import SLOT, Area, ScratchAreas, address, chunks
from ucm.adapters.mooncake.session import StoreSession
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError

log = logging.getLogger(__name__)


class MooncakeAdapter(BudgetedAdapter):
    """Framed blocks in a Mooncake Store pool."""

    name = "mooncake"
    kv_medium = "EXTERNAL"
    Config = MooncakeConfig

    def __init__(self, capacity_bytes: int, config: MooncakeConfig,
                 store_factory: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`store_factory()` makes the store client (one per setup; by default
        the package's `MooncakeDistributedStore`). Wrapping the real client
        injects faults in tests. `clock`: the time the circuit breaker reads
        (tests hold it still)."""
        self._budget = ClusterBudget("mooncake", capacity_bytes)  # the objects this instance relies on
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise AdapterError("mooncake: the mooncake-transfer-engine package is not installed "
                               "(pip install mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda)") from exc
        self.config = config
        self._breaker = CircuitBreaker("mooncake", f"master {config.master}", config.retry_after_s, clock=clock)
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        direct = config.zero_copy_unregistered
        self._direct_any = (config.protocol == "tcp") if direct is None else direct
        self._prefix = config.key_prefix
        self._lock = threading.Lock()  # guards _stats
        self._recovery = DeadHolderRecovery(config.key_prefix, config.probe_timeout_s, self._budget)
        self._stats = {"bytes_in": 0, "bytes_out": 0, "hits": 0, "misses": 0, "corrupt": 0, "no_space": 0,
                       "failed": 0, "unreadable_removed": 0, "staged_bytes": 0}
        # Scratch: per area, header slots then staging; registered with each client.
        self._scratch = ScratchAreas(config.staging_size, config.concurrency)
        self._movers = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="ucm-mooncake")
        self._session = StoreSession(config, store_factory or MooncakeDistributedStore, self._breaker,
                                     (self._scratch.address, len(self._scratch.view)))

    # ---- the client and registered memory ------------------------------------
    @property
    def client(self) -> Any:
        """The underlying `MooncakeDistributedStore` (None until set up);
        for benchmarks and tools that need the raw client."""
        return self._session.store

    def key_name(self, key: Key) -> str:
        """The store key a block lives under."""
        return self._prefix + framing.check_key(key).hex()

    def register_memory(self, buf: Any) -> None:
        """Registers long-lived memory (the DRAM arena) so that blocks in it
        move without staging on every protocol. The caller keeps `buf` alive
        until `unregister_memory(buf)` or close()."""
        self._session.register_memory(buf)

    def unregister_memory(self, buf: Any) -> None:
        self._session.unregister_memory(buf)

    def _client(self) -> Any:
        """The client if calls may go to the network now, else None."""
        return self._session.client()

    # ---- batches -----------------------------------------------------------
    def _check_stageable(self, views: Sequence[memoryview]) -> None:
        """Raises before any I/O if a buffer would need staging but cannot fit."""
        if self._direct_any:
            return
        room = self._scratch.staging_share // 2
        for v in views:
            if len(v) > room and not self._session.registered(address(v), len(v)):
                raise ArgumentError(
                    f"mooncake: a {len(v)}-byte buffer outside registered memory exceeds the staging room "
                    f"of {room} bytes (staging_size / concurrency / 2); raise staging_size or register_memory()")

    def _chunks(self, area: Area, views: Sequence[memoryview], idx: Sequence[int]) -> Iterator[list[tuple]]:
        """Store calls of the items `idx` (see `scratch.chunks`)."""
        return chunks(area, views, idx, self.config.chunk_bytes,
                      lambda v, addr: self._direct_any or self._session.registered(addr, len(v)))

    def _take_area(self) -> Optional[Area]:
        return self._scratch.take(self.config.wait_s)

    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        views = [byte_view(b, what="blob") for b in blobs]
        names = [self.key_name(k) for k in keys]
        self._check_stageable(views)
        out: list[Optional[Status]] = [None] * len(keys)
        store = self._client()
        if store is None:
            with self._lock:
                self._stats["failed"] += len(keys)
            return [Status.FAILED] * len(keys)
        if self._recovery.any_unreadable():  # remove them first; those still there are FAILED
            stuck = self._recovery.clear_for_put(store, keys, names)
            for i in stuck:
                out[i] = Status.FAILED
            if stuck:
                with self._lock:
                    self._stats["failed"] += len(stuck)
        sizes = [len(v) for v in views]
        res = self._budget.reserve(keys, sizes, only=[i for i, s in enumerate(out) if s is None])
        todo = res.todo
        for i, s in enumerate(res.out):
            if s is not None:
                out[i] = s
        with self._lock:
            self._stats["no_space"] += res.out.count(Status.NO_SPACE)
        try:
            if todo:
                self._put_items(store, keys, names, views, todo, out)
        finally:
            new = self._budget.settle((keys[i], sizes[i], out[i] is Status.OK) for i in todo)
            with self._lock:
                self._stats["bytes_in"] += sum(sizes[i] for i, n in zip(todo, new) if n)
                for i in todo:
                    if out[i] is not Status.OK:
                        self._stats["no_space" if out[i] is Status.NO_SPACE else "failed"] += 1
        return [s if s is not None else Status.FAILED for s in out]

    def _put_items(self, store: Any, keys: Sequence[Key], names: list[str], views: list[memoryview],
                   todo: list[int], out: list[Optional[Status]]) -> None:
        """Checksums (and stages) chunk k+1 while chunk k is transferred."""
        area = self._take_area()
        if area is None:
            return  # FAILED
        pending: Optional[tuple[list[tuple], Future]] = None
        staged = 0
        try:
            for chunk in self._chunks(area, views, todo):
                ptrs, sizes = [], []
                for i, slot, addr, off in chunk:
                    v = views[i]
                    framing.pack_header_into(area.headers, slot * SLOT, keys[i], len(v), _native.checksum(v))
                    if addr is None:
                        _native.copy(area.staging[off:off + len(v)], v)
                        addr = area.staging_addr + off
                        staged += len(v)
                    h = area.headers_addr + slot * SLOT
                    ptrs.append([h, addr] if len(v) else [h])
                    sizes.append([framing.HEADER_BYTES, len(v)] if len(v) else [framing.HEADER_BYTES])
                if pending is not None:
                    self._finish_put(*pending, keys, out)
                    pending = None
                fut = self._movers.submit(store.batch_put_from_multi_buffers, [names[c[0]] for c in chunk],
                                          ptrs, sizes, self._replicate)
                pending = (chunk, fut)
            if pending is not None:
                self._finish_put(*pending, keys, out)
                pending = None
        finally:
            if pending is not None:  # never hand back scratch memory a transfer may still use
                futures_wait([pending[1]])
            self._scratch.give(area)
            if staged:
                with self._lock:
                    self._stats["staged_bytes"] += staged

    def _finish_put(self, chunk: list[tuple], fut: Future, keys: Sequence[Key],
                    out: list[Optional[Status]]) -> None:
        codes = fut.result()
        for (i, *_), code in zip(chunk, codes):
            out[i] = self._put_status(code)
            if code == OBJECT_ALREADY_EXISTS and self._recovery.is_unreadable(keys[i]):
                out[i] = Status.FAILED  # found unreadable by a concurrent get since: not a copy to rely on

    def _put_status(self, code: int) -> Status:
        if code == 0 or code == OBJECT_ALREADY_EXISTS:
            return Status.OK
        if code in (NO_AVAILABLE_HANDLE, TENANT_QUOTA_EXCEEDED):
            return Status.NO_SPACE
        if code in UNREACHABLE:
            self._breaker.trip(code)
        else:
            log.warning("mooncake: put failed (%s)", code)
        return Status.FAILED

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        names = [self.key_name(k) for k in keys]
        if len(set(names)) < len(names):
            return self._get_each_once(keys, dsts, names)
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        self._check_stageable(views)
        out: list[Status] = [Status.FAILED] * len(keys)
        gone: set[int] = set()  # misses because the object is no longer in the pool
        unreadable: list[int] = []  # transfer failed while the object is listed
        removed: set[int] = set()  # of those, taken out of the pool here
        store = self._client()
        if store is not None and keys:
            self._get_items(store, keys, names, views, out, gone, unreadable)
            if unreadable:
                for i, ok in zip(unreadable, self._recovery.remove_dead(store, [names[i] for i in unreadable])):
                    if ok:
                        out[i] = Status.NOT_FOUND
                        removed.add(i)
        readable: list[Key] = []  # read whole, or removed: no longer unreadable
        with self._lock:
            for i, (key, v, s) in enumerate(zip(keys, views, out)):
                if s is Status.OK:
                    self._stats["hits"] += 1
                    self._stats["bytes_out"] += len(v)
                    readable.append(key)
                elif s is Status.NOT_FOUND:
                    self._stats["misses"] += 1
                    if i in removed:
                        self._stats["unreadable_removed"] += 1
                        readable.append(key)
                        self._budget.gone([key], report=True)
                    elif i in gone:
                        self._budget.gone([key])
                elif s is Status.CORRUPT:
                    self._stats["corrupt"] += 1
                else:
                    self._stats["failed"] += 1
        if readable:
            self._recovery.readable(readable)
        return out

    def _get_each_once(self, keys: Sequence[Key], dsts: Sequence[Any], names: list[str]) -> list[Status]:
        """A get of a batch that names a key more than once, as batches that
        name each key once: the store's batch get answers the full size for
        every copy of a repeated name, yet not every copy's header verifies,
        so a good object would read as CORRUPT. The first time each key is
        named goes in one batch, the rest in the next (which splits again if
        it still repeats a key)."""
        first: dict[str, int] = {}
        for i, n in enumerate(names):
            first.setdefault(n, i)
        once = sorted(first.values())
        again = [i for i, n in enumerate(names) if first[n] != i]
        out: list[Status] = [Status.FAILED] * len(keys)
        for part in (once, again):
            for i, s in zip(part, self.get([keys[i] for i in part], [dsts[i] for i in part])):
                out[i] = s
        return out

    def _get_items(self, store: Any, keys: Sequence[Key], names: list[str], views: list[memoryview],
                   out: list[Status], gone: set[int], unreadable: list[int]) -> None:
        """Verifies (and unstages) chunk k while chunk k+1 is transferred."""
        area = self._take_area()
        if area is None:
            return
        pending: Optional[tuple[list[tuple], Future]] = None
        staged = 0
        try:
            for chunk in self._chunks(area, views, range(len(keys))):
                ptrs, sizes = [], []
                for i, slot, addr, off in chunk:
                    n = len(views[i])
                    h = area.headers_addr + slot * SLOT
                    target = area.staging_addr + off if addr is None else addr
                    ptrs.append([h, target] if n else [h])
                    sizes.append([framing.HEADER_BYTES, n] if n else [framing.HEADER_BYTES])
                fut = self._movers.submit(store.batch_get_into_multi_buffers, [names[c[0]] for c in chunk],
                                          ptrs, sizes)
                if pending is not None:
                    staged += self._finish_get(store, area, *pending, names, keys, views, out, gone, unreadable)
                pending = (chunk, fut)
            if pending is not None:
                staged += self._finish_get(store, area, *pending, names, keys, views, out, gone, unreadable)
                pending = None
        finally:
            if pending is not None:
                futures_wait([pending[1]])
            self._scratch.give(area)
            if staged:
                with self._lock:
                    self._stats["staged_bytes"] += staged

    def _finish_get(self, store: Any, area: Area, chunk: list[tuple], fut: Future, names: list[str],
                    keys: Sequence[Key], views: list[memoryview], out: list[Status], gone: set[int],
                    unreadable: list[int]) -> int:
        codes = fut.result()
        staged = 0
        for (i, slot, addr, off), code in zip(chunk, codes):
            v = views[i]
            if code == framing.HEADER_BYTES + len(v):
                payload = v if addr is not None else area.staging[off:off + len(v)]
                header = area.headers[slot * SLOT:slot * SLOT + framing.HEADER_BYTES]
                out[i] = framing.verify(keys[i], header, payload)
                if out[i] is Status.OK and addr is None:
                    _native.copy(v, payload)
                    staged += len(v)
            else:
                out[i] = self._get_status(store, code, names[i], framing.HEADER_BYTES + len(v))
                if code == OBJECT_NOT_FOUND or (out[i] is Status.NOT_FOUND and code in SIZE_CODES):
                    gone.add(i)
                elif code == TRANSFER_FAIL and out[i] is Status.FAILED:  # listed, right size, not read
                    unreadable.append(i)
        return staged

    def _get_status(self, store: Any, code: int, name: str, expected: int) -> Status:
        """The outcome of a get that did not return the object."""
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, LEASE_EXPIRED):
            return Status.NOT_FOUND  # gone, still being written, or possibly overwritten under the reader
        if code >= 0:
            return Status.CORRUPT  # a short or long object
        if code in SIZE_CODES:  # the sizes disagree, or the transfer failed: ask which
            size = store.get_size(name)
            if size == OBJECT_NOT_FOUND:
                return Status.NOT_FOUND
            if size >= 0 and size != expected:
                return Status.CORRUPT  # the stored object's size is not header + destination
            return Status.FAILED
        if code in UNREACHABLE:
            self._breaker.trip(code)
        return Status.FAILED

    # ---- the rest of the contract ------------------------------------------
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        names = [self.key_name(k) for k in keys]
        store = self._client()
        if store is None or not keys:
            return [False] * len(keys)
        codes = store.batch_is_exist(names)
        self._budget.gone(k for k, code in zip(keys, codes) if code == 0)
        if any(c in UNREACHABLE or c == -1 for c in codes):
            self._breaker.trip(min(codes))
        return [c == 1 for c in codes]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        names = [self.key_name(k) for k in keys]
        store = self._client()
        if store is None or not keys:
            return [False] * len(keys)
        codes = store.batch_remove(names, self.config.force_delete)
        self._budget.forget(keys)
        return [c == 0 for c in codes]

    def size_of(self, key: Key) -> Optional[int]:
        name = self.key_name(key)
        store = self._client()
        if store is None:
            return None
        n = store.get_size(name)
        if n == OBJECT_NOT_FOUND:
            self._budget.gone([key])
        return n - framing.HEADER_BYTES if n >= framing.HEADER_BYTES else None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = dict(self._stats)
        ready = self._session.store is not None
        return dict(out, setups=self._session.setups, **self._budget.stats(), outages=self._breaker.outages, refused_calls=self._breaker.refused,
                    down=self._breaker.down, master=self.config.master,
                    ready=ready, healthy=ready and self._breaker.healthy, zero_copy_unregistered=self._direct_any)

    def close(self) -> None:
        """Leaves the pool: objects held in this node's segment go with it."""
        if not self._session.stop():
            return
        if not self._scratch.take_all(self.config.wait_s):  # wait for calls still moving data
            log.warning("mooncake: a call still holds scratch memory at close")
            return  # keep the scratch mapped: a transfer may still use it
        self._movers.shutdown(wait=True)
        self._session.close()
        self._scratch.unmap()
