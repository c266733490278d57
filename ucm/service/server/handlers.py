"""The service's operations, declared as data: what each wire op does to the
cache, and whether it may block.

Every op is a method marked `@op(name, blocking=...)`; `OPS` collects them.
`blocking=True` means the op may touch an adapter (I/O, the network, or a
lock an adapter holds across either), so the event loop
(ucm.service.server.loop) runs it on a worker thread, never on its own thread.
The reason is written beside each flag. The abort done when a connection
drops (`disconnect`) runs on a worker too.

A connection (`ConnState`) owns its reservations, leases and pins; they
are given back when it drops. One request per connection runs at a time
(the loop's ordering), so a ConnState is touched by one thread at a time;
the table of them is guarded by `_lock`.

Every argument from the wire is checked before use: a bad one (a key of the
wrong length, a request id that is not a short string) is a refusal reply
(`ProtocolError`), never an exception out of the service.

Lock order: `_lock`, then nothing (the cache is never called under it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from ucm import __version__
from ucm.api import check_blocks, check_timeout
from ucm.codecs.layout import KvLayout
from ucm.errors import ArgumentError, UcmError
from ucm.layer_stream import word_count
from ucm.service import protocol as proto

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    blocking: bool  # may touch an adapter: runs on a worker thread
    method: str


def op(name: str, *, blocking: bool) -> Callable[[Callable], Callable]:
    """Declares the decorated method as the handler of wire op `name`."""
    def mark(fn: Callable) -> Callable:
        fn.op_spec = OpSpec(name, blocking, fn.__name__)  # type: ignore[attr-defined]
        return fn
    return mark


class ConnState:
    """What one connection owns; given back when it drops."""

    __slots__ = ("id", "leases", "reserved", "pins", "next_lease", "streams")

    def __init__(self, cid: int) -> None:
        self.id = cid
        self.leases: dict[int, Any] = {}  # lease id -> the cache's Lease
        self.reserved: set[bytes] = set()
        self.pins: Counter = Counter()
        self.next_lease = 1
        self.streams: dict[int, "_StreamRecord"] = {}  # stream id (a lease id) -> its record


class _StreamRecord:
    """A streamed load handed to a connection, and its progress words: given
    back once the client released it and the cache finished writing them."""

    __slots__ = ("stream", "at", "n", "released", "finished", "lock")

    def __init__(self, at: int, n: int) -> None:
        self.stream: Any = None
        self.at, self.n = at, n
        self.released = self.finished = False
        self.lock = threading.Lock()


class ServiceHandlers:
    """The ops of `ucm serve` over one UnifiedCache (a `loop.Handler`).

    `cache` is the built cache; `arena` its shared landing adapter (a
    SharedSlots), the tier named `landing_tier`; `epoch` and `arena_inode` the instance's identity, stamped
    on every slot handed out; `index` the shared key index or None;
    `metrics` the Prometheus endpoint or None; `socket` the socket path
    (for stats)."""

    def __init__(self, cache: Any, arena: Any, *, landing_tier: str, epoch: int, arena_inode: int,
                 block_tokens: int, max_keys: int, prefetch_timeout_s: float, socket: str, index: Any = None,
                 metrics: Any = None, progress: Any = None) -> None:
        self.cache = cache
        self.arena = arena
        self.landing_tier = landing_tier
        # Read once: `hello` (on the loop thread) touches no adapter.
        self.arena_path: str = arena.segment_path
        self.arena_bytes: int = arena.capacity_bytes
        self.epoch = epoch
        self.arena_inode = arena_inode
        self.block_tokens = block_tokens
        self.max_keys = max_keys
        self.prefetch_timeout_s = prefetch_timeout_s
        self.socket = socket
        self.index = index
        self.metrics = metrics
        self.progress = progress  # ucm.service.progress.ProgressArea, or None: no streamed loads
        self.shared_tiers = any(a.shared for a in cache.adapters)
        self._states: dict[int, ConnState] = {}
        self._lock = threading.Lock()

    # ---- loop.Handler --------------------------------------------------------
    def connect(self, cid: int) -> ConnState:
        state = ConnState(cid)
        with self._lock:
            self._states[cid] = state
        return state

    def blocking(self, name: str) -> bool:
        spec = OPS.get(name)
        return spec is not None and spec.blocking

    def handle(self, state: ConnState, rid: int, name: str, args: Any) -> bytes:
        spec = OPS.get(name)
        if spec is None:
            return proto.pack([rid, False, f"unknown op {name!r}; known: {sorted(OPS)}"])
        t0 = time.perf_counter()
        try:
            reply = [rid, True, getattr(self, spec.method)(state, args)]
        except (proto.ProtocolError, UcmError) as exc:
            reply = [rid, False, str(exc)]
        except Exception as exc:  # a bug in one request must not take the service down
            log.exception("ucm serve: op %s failed", name)
            reply = [rid, False, f"internal error: {type(exc).__name__}: {exc}"]
        if self.metrics is not None:
            self.metrics.observe(name, time.perf_counter() - t0)
        try:
            return proto.pack(reply)
        except Exception as exc:  # an unpackable result is a bug, answered as one
            log.exception("ucm serve: op %s: reply not packable", name)
            return proto.pack([rid, False, f"internal error: {type(exc).__name__}"])

    def disconnect(self, state: ConnState) -> None:
        """Gives back the leases, reservations (an abort: touches the
        landing adapter and may wait on the cache) and pins of `state`."""
        with self._lock:
            self._states.pop(state.id, None)
        leases, reserved, pins = list(state.leases.values()), list(state.reserved), list(state.pins.elements())
        for rec in list(state.streams.values()):
            self._release_stream(rec)
        state.streams.clear()
        state.leases.clear()
        state.reserved.clear()
        state.pins.clear()
        if leases:
            self.cache.release(leases)
        if reserved:
            self.cache.abort(reserved)
        if pins:
            self.cache.unpin(pins)

    # ---- argument helpers ----------------------------------------------------
    def _keys(self, args: Any, allowed: set[str], name: str = "keys") -> list[bytes]:
        proto.check_args(args, allowed)
        return proto.keys_arg(args, name, self.max_keys)

    # ---- operations ----------------------------------------------------------
    @op("hello", blocking=False)  # the instance's identity: no adapter
    def _hello(self, conn: ConnState, args: Any) -> dict:
        proto.check_args(args, {"version"})
        if args.get("version") != proto.VERSION:
            raise proto.ProtocolError(f"protocol version {args.get('version')!r} not supported; "
                                      f"this service speaks {proto.VERSION}")
        return {"version": proto.VERSION, "ucm": __version__, "pid": os.getpid(), "epoch": self.epoch,
                "arena_path": self.arena_path, "arena_bytes": self.arena_bytes,
                "arena_inode": self.arena_inode,
                "block_tokens": self.block_tokens, "tiers": self.cache.tier_names,
                "landing_tier": self.landing_tier,
                "index_path": self.index.path if self.index else None,
                "index_bytes": self.index.nbytes if self.index else 0,
                "progress_path": self.progress.path if self.progress else None,
                "progress_bytes": self.progress.nbytes if self.progress else 0,
                "shared_tiers": self.shared_tiers}

    @op("layout", blocking=False)  # the codec tiers' layout book, in memory only
    def _layout(self, conn: ConnState, args: Any) -> None:
        proto.check_args(args, {"layout"})
        data = args.get("layout")
        if not isinstance(data, bytes) or len(data) > 1 << 16:
            raise proto.ProtocolError("layout: expected the bytes of a KvLayout (at most 64 KiB)")
        try:
            layout = KvLayout.from_bytes(data)
        except ArgumentError as exc:
            raise proto.ProtocolError(f"layout: {exc}") from None
        self.cache.register_layout(layout)

    @op("begin", blocking=False)  # the placement policy's clock, under the cache's metadata lock only
    def _begin(self, conn: ConnState, args: Any) -> None:
        keys = self._keys(args, {"request_id", "keys", "parent"})
        rid = proto.request_id_arg(args)
        if rid is None:
            raise proto.ProtocolError("request_id: begin needs a request id (a string)")
        self.cache.begin_request(rid, keys, proto.opt_key_arg(args, "parent"))

    @op("lookup", blocking=True)  # a shared (cluster) tier's `contains` goes over the network
    def _lookup(self, conn: ConnState, args: Any) -> int:
        return self.cache.lookup(self._keys(args, {"keys"}))

    @op("locate", blocking=True)  # as lookup
    def _locate(self, conn: ConnState, args: Any) -> list:
        return self.cache.locate(self._keys(args, {"keys"}))

    @op("reserve", blocking=True)  # evictions and demotions: NVMe and cluster writes
    def _reserve(self, conn: ConnState, args: Any) -> dict:
        keys = self._keys(args, {"keys", "sizes", "parent", "request_id", "counted"})
        sizes = proto.ints_arg(args, "sizes", len(keys), 1, self.arena_bytes)
        parent = proto.opt_key_arg(args, "parent")
        rid = proto.request_id_arg(args)
        counted = proto.bool_arg(args, "counted", True)
        out: list[Any] = []
        for key, r in zip(keys, self.cache.reserve(keys, sizes, parent, request_id=rid, counted=counted)):
            if r is None or r is True:
                out.append(r)
                continue
            r.release()
            off = self.arena.slot_offset(key)
            conn.reserved.add(key)
            out.append([off[0], off[1]])
        return {"epoch": self.epoch, "slots": out}

    # Not blocking: a commit only publishes filled arena slots (the shared-slot
    # landing tier's index, in memory under its own lock), unholds them under
    # the cache's metadata lock (never held across I/O) and wakes the reclaim
    # thread, which demotes on its own thread; accelerator hooks must not block.
    @op("commit", blocking=False)
    def _commit(self, conn: ConnState, args: Any) -> list:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        return self.cache.commit(keys)

    @op("abort", blocking=True)  # the landing adapter, and the cache undoes the placement
    def _abort(self, conn: ConnState, args: Any) -> None:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        self.cache.abort(keys)

    @op("acquire", blocking=True)  # stages blocks from NVMe or a cluster tier first
    def _acquire(self, conn: ConnState, args: Any) -> dict:
        keys = self._keys(args, {"keys", "request_id", "counted"})
        rid = proto.request_id_arg(args)
        counted = proto.bool_arg(args, "counted", True)
        out: list[Any] = []
        for lease in self.cache.acquire(keys, request_id=rid, counted=counted):
            if lease is None:
                out.append(None)
                continue
            lid = conn.next_lease
            conn.next_lease += 1
            conn.leases[lid] = lease
            out.append([lid, lease.offset, lease.length])
        return {"epoch": self.epoch, "slots": out}

    # Not blocking: a SharedSlots lease is given back in memory, under the
    # adapter's own lock, which no copy or I/O runs under (base.py), so
    # releases never queue behind an NVMe read on the workers.
    @op("release", blocking=False)
    def _release(self, conn: ConnState, args: Any) -> None:
        proto.check_args(args, {"leases"})
        ids = args.get("leases")
        if not isinstance(ids, list) or len(ids) > self.max_keys:
            raise proto.ProtocolError("leases: expected a list of lease ids")
        self.cache.release([conn.leases.pop(i) for i in ids if type(i) is int and i in conn.leases])

    @op("stream", blocking=True)  # stages from NVMe: evictions, reservations (the layer reads run on)
    def _stream(self, conn: ConnState, args: Any) -> dict:
        """A streamed load: slots now, progress in the shared words at
        `words` (ucm.layer_stream); `stream_release` gives it back."""
        keys = self._keys(args, {"keys", "sizes", "layers", "request_id"})
        sizes = proto.ints_arg(args, "sizes", len(keys), 1, self.arena_bytes)
        layers = proto.int_arg(args, "layers", 1, 1 << 16)
        rid = proto.request_id_arg(args)
        if self.progress is None:
            raise proto.ProtocolError("stream: this service keeps no progress words")
        n = word_count(len(keys))
        at = self.progress.alloc(n)
        if at is None:
            raise UcmError(f"stream: no room for {n} progress words (all taken by streams in flight)")
        rec = _StreamRecord(at, n)
        try:
            rec.stream = self.cache.stream_slots(keys, sizes, layers, request_id=rid,
                                                 words=self.progress.view(at, n),
                                                 on_done=lambda _s: self._stream_finished(rec))
        except ArgumentError as exc:
            self.progress.free(at, n)
            raise proto.ProtocolError(str(exc)) from None
        except BaseException:  # refused (a closing cache, a bug): its words are not the stream's
            self.progress.free(at, n)
            raise
        sid = conn.next_lease
        conn.next_lease += 1
        conn.streams[sid] = rec
        return {"epoch": self.epoch, "sid": sid, "words": at,
                "slots": [list(s) if s is not None else None for s in rec.stream.slots]}

    @op("stream_release", blocking=False)  # leases given back in memory, as release
    def _stream_release(self, conn: ConnState, args: Any) -> None:
        proto.check_args(args, {"sid"})
        sid = args.get("sid")
        rec = conn.streams.pop(sid, None) if type(sid) is int else None
        if rec is not None:
            self._release_stream(rec)

    def _release_stream(self, rec: _StreamRecord) -> None:
        rec.stream.release()
        with rec.lock:
            rec.released = True
            free = rec.finished
        if free:
            self.progress.free(rec.at, rec.n)

    def _stream_finished(self, rec: _StreamRecord) -> None:  # on a cache thread, once the words are final
        with rec.lock:
            rec.finished = True
            free = rec.released
        if free:
            self.progress.free(rec.at, rec.n)

    @op("prefetch", blocking=True)  # NVMe or cluster reads
    def _prefetch(self, conn: ConnState, args: Any) -> list:
        h = self.cache.prefetch(self._keys(args, {"keys"}))
        res = h.wait(self.prefetch_timeout_s)
        return [o.value for o in res] if res is not None else ["failed"] * len(h.results)

    @op("pin", blocking=False)  # placement only, under the cache's metadata lock
    def _pin(self, conn: ConnState, args: Any) -> None:
        keys = self._keys(args, {"keys"})
        self.cache.pin(keys)
        conn.pins.update(keys)

    @op("unpin", blocking=False)  # as pin
    def _unpin(self, conn: ConnState, args: Any) -> None:
        # At most as many unpins per key as this connection pinned it: a
        # key named twice must not release another connection's pin.
        keys = []
        for k, n in Counter(self._keys(args, {"keys"})).items():
            keys.extend([k] * min(n, conn.pins.get(k, 0)))
        conn.pins.subtract(keys)
        conn.pins += Counter()  # drop zero counts
        self.cache.unpin(keys)

    @op("finish", blocking=False)  # a placement hint, under the cache's metadata lock
    def _finish(self, conn: ConnState, args: Any) -> None:
        keys = self._keys(args, {"keys", "output_tokens", "request_id"})
        tokens = proto.int_arg(args, "output_tokens", 0, 1 << 40)
        self.cache.finish(keys, tokens, request_id=proto.request_id_arg(args))

    @op("describe", blocking=True)  # the block catalog, and its file with events.path
    def _describe(self, conn: ConnState, args: Any) -> None:
        proto.check_args(args, {"blocks"})
        blocks = args.get("blocks")
        if not isinstance(blocks, list) or len(blocks) > self.max_keys:
            raise proto.ProtocolError(f"blocks: expected a list of at most {self.max_keys} blocks")
        self.cache.describe(check_blocks(blocks))

    @op("events", blocking=True)  # its sweep locates blocks: a shared tier's `contains` goes over the network
    def _events(self, conn: ConnState, args: Any) -> dict:
        proto.check_args(args, {"since", "epoch", "limit"})
        epoch = args.get("epoch")
        if epoch is not None:
            epoch = proto.int_arg(args, "epoch", 0, (1 << 63) - 1)
        return self.cache.events(proto.int_arg(args, "since", 0, (1 << 63) - 1), epoch,
                                 proto.int_arg(args, "limit", 1, 4096))

    @op("holdings", blocking=False)  # the block catalog, in memory only
    def _holdings(self, conn: ConnState, args: Any) -> dict:
        proto.check_args(args, {"offset", "limit"})
        return self.cache.holdings(proto.int_arg(args, "offset", 0, 1 << 40), proto.int_arg(args, "limit", 1, 4096))

    @op("stats", blocking=True)  # every adapter's stats (nvme's take its lock)
    def _stats(self, conn: ConnState, args: Any) -> dict:
        proto.check_args(args, set())
        s = self.cache.stats()
        with self._lock:
            states = list(self._states.values())
        s["service"] = {"pid": os.getpid(), "socket": self.socket, "connections": len(states),
                        "leases": sum(len(c.leases) for c in states),
                        "reserved": sum(len(c.reserved) for c in states),
                        "metrics": self.metrics.address if self.metrics else None}
        return s

    @op("flush", blocking=True)  # waits for NVMe writes
    def _flush(self, conn: ConnState, args: Any) -> bool:
        proto.check_args(args, {"timeout_s"})
        try:
            timeout_s = check_timeout(args.get("timeout_s", 60.0))
        except ArgumentError as exc:
            raise proto.ProtocolError(str(exc)) from None
        return self.cache.flush(timeout_s=timeout_s)


OPS: dict[str, OpSpec] = {fn.op_spec.name: fn.op_spec for fn in vars(ServiceHandlers).values()
                          if hasattr(fn, "op_spec")}
