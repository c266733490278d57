"""CacheClient: `ucm.api.CacheAPI` across the process boundary.

Connectors hold a CacheAPI and do not care that the cache lives in
`ucm serve`. This module imports neither the server nor the cache: an
engine worker loads the client, `ucm.api`, the protocol and the key index
reader only (`connect`, which may start a private service, is in
ucm.service.client.spawn). Control requests go over the Unix socket; payloads are copied
by this process straight into and out of the service's shared-memory arena.

Faults are values: when the service is down or dies mid-request, `lookup`
answers 0, loads report MISSING, stores report FAILED, and the client
reconnects on a later call (at most every `retry_s`) and re-maps the arena
of the restarted service. Only misuse (bad keys, buffers, sizes or request
ids, checked here as `UnifiedCache` checks them) raises.

Request events (see ucm.api): `begin_request` is the op `begin`; the
`request_id` of store/load/write_slots/read_slots travels on every
`reserve`/`acquire` of the call's chunks, and that of `finish` on `finish`.

A connection (`Link`, ucm/service/client/link.py) is built whole by the
`ClientConnection` mixin (ucm/service/client/conn.py) before it is
published: its socket, the service's `hello` (pid, epoch, arena
identity), the arena mapping, the key index mapping and the liveness poll. Any error on the way (an
unopenable or unmappable arena, EMFILE, ENOMEM, a refused hello) is
"service unavailable", and the previous state stays as it was. Every slot
handed out over a link is filled only through that link's own arena, and
only when the reply carries the link's epoch and lies inside the arena;
its commit or release goes over the same link. A link that fails while
copies into or out of its slots are still running is retired but its
socket stays open until the last of them ends, so the service cannot hand
those slots to anyone else mid-copy (the service gives back what a
connection held only when it closes).

Thread-safe: `_lock` serialises requests on the socket and guards the
links, their in-flight counts and the mappings; copies run outside it (on
a small pool that completes the Handles, or on the caller's thread for
read_slots / write_slots); lookups read the service's shared key index
under `_index_lock`. Lock order: `_lock`, then `_index_lock`.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from ucm import _native
from ucm.api import (Handle, Key, Outcome, RangeRead, SlotFn, check_keys, check_output_tokens, check_parent,
                     check_ranges, check_request_id, check_sizes, check_timeout, cut_parts, submit)
from ucm.buffers import byte_view
from ucm.codecs.layout import KvLayout
from ucm.config.schema import UcmConfig
from ucm.errors import ArgumentError, ClosedError
from ucm.service.client import slots as client_slots
from ucm.service.client.conn import ClientConnection
from ucm.service.client.link import Link, Mapping, ServiceUnavailable, hung_up

log = logging.getLogger(__name__)


class CacheClient(ClientConnection):
    def __init__(self, path: str, config: Optional[UcmConfig] = None, io_workers: int = 2,
                 retry_s: float = 0.5, connect: bool = True, use_index: bool = True,
                 socket_factory: Optional[Callable[[], socket.socket]] = None) -> None:
        """`socket_factory` makes the connection's socket (a Unix stream
        socket by default); tests wrap a real socket through it to inject
        faults."""
        self.path = path
        self.config = config or UcmConfig()
        self._timeout = self.config.service.request_timeout_s
        self._limit = self.config.service.max_frame_bytes
        self._retry_s = retry_s
        self._spin_s = self.config.service.poll_spin_us / 1e6
        self._socket_factory = socket_factory or (lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        self._lock = threading.Lock()  # one request at a time on the socket; links and mappings
        self._index_lock = threading.Lock()  # lookups reading the current link's index
        self._link: Optional[Link] = None
        self._maps: dict[tuple, Mapping] = {}  # arena and index mappings by identity
        self._kept: Optional[tuple] = None  # the last arena, kept mapped for a reconnect to it
        self.service_info: dict[str, Any] = {}
        self._use_index = use_index  # False: every lookup is a request over the socket
        self._rid = 0
        self._layouts: list[bytes] = []  # registered KV layouts, sent again on every new connection
        self._next_try = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="ucm-client")
        self.spawned: Optional[subprocess.Popen] = None
        if connect:
            with self._lock:
                try:
                    self._connect_locked()
                except ServiceUnavailable:
                    pass

    # ---- ucm.api.CacheAPI ----------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        keys = _keys(keys)
        if not keys:
            return 0
        n = self._lookup_index(keys)
        return n if n is not None else self._try("lookup", {"keys": keys}, 0)

    def _lookup_index(self, keys: list[bytes]) -> Optional[int]:
        """The answer from the shared key index, or None to ask the service:
        no index, no live connection, an inconsistent read, or a partial hit
        that blocks other nodes put into a shared tier might extend."""
        # Not under self._lock: a long request (a load from NVMe) on another
        # thread must not hold up lookups.
        with self._index_lock:
            link = self._link
            if link is None or link.index is None:
                return None
            # A dead service hangs up its end: its index is stale from then on.
            dead = hung_up(link)
            n = -1 if dead else _native.index_prefix(link.index.m, b"".join(keys))
        if dead:
            with self._lock:
                self._retire_locked(link, backoff=False)
            return None
        if n < 0 or (n < len(keys) and link.info.get("shared_tiers")):
            return None
        return n

    def locate(self, keys: Sequence[Key]) -> list[Optional[str]]:
        keys = _keys(keys)
        return self._try("locate", {"keys": keys}, [None] * len(keys))

    def pin(self, keys: Sequence[Key]) -> None:
        self._try("pin", {"keys": _keys(keys)}, None)

    def unpin(self, keys: Sequence[Key]) -> None:
        self._try("unpin", {"keys": _keys(keys)}, None)

    def register_layout(self, layout: KvLayout) -> None:
        """The KV layout of a namespace's blocks, for the service's codec
        tiers; kept and sent again whenever the client connects anew."""
        if not isinstance(layout, KvLayout):
            raise ArgumentError(f"register_layout: expected a KvLayout, got {type(layout).__name__}")
        data = layout.to_bytes()
        with self._lock:
            if data in self._layouts:
                return
            self._layouts.append(data)
        self._try("layout", {"layout": data}, None)

    def begin_request(self, request_id: str, keys: Sequence[Key], parent: Optional[Key] = None) -> None:
        rid = check_request_id(request_id)
        if rid is None:
            raise ArgumentError("begin_request: request_id must be a string of 1 to 256 characters, got None")
        self._try("begin", {"request_id": rid, "keys": _keys(keys), "parent": check_parent(parent)}, None)

    def finish(self, keys: Sequence[Key], output_tokens: int, request_id: Optional[str] = None) -> None:
        n = check_output_tokens(output_tokens)
        rid = check_request_id(request_id)
        self._try("finish", {"keys": _keys(keys), "output_tokens": n, "request_id": rid}, None)

    def stats(self) -> dict[str, Any]:
        return self._try("stats", {}, {"available": False})

    def flush(self, timeout_s: float = 60.0) -> bool:
        timeout_s = check_timeout(timeout_s, "flush: timeout_s")
        return bool(self._try("flush", {"timeout_s": timeout_s}, False))

    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None,
              request_id: Optional[str] = None) -> Handle:
        keys = _keys(keys)
        views = _views(keys, srcs, writable=False)
        parent = check_parent(parent)
        rid = check_request_id(request_id)
        return self._submit(len(keys), self._store, keys, views, parent, rid)

    def load(self, keys: Sequence[Key], dsts: Sequence[Any], request_id: Optional[str] = None) -> Handle:
        keys = _keys(keys)
        views = _views(keys, dsts, writable=True)
        rid = check_request_id(request_id)
        return self._submit(len(keys), self._load, keys, views, rid)

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        keys = _keys(keys)
        landing = self.service_info.get("landing_tier")  # as announced by the last service reached
        if tier is not None and landing is not None and tier != landing:
            raise ArgumentError(f"prefetch: blocks are staged into the landing tier {landing!r}, got tier={tier!r}")

        def run() -> list[Outcome]:
            res = self._try("prefetch", {"keys": keys}, None)
            return [Outcome(r) for r in res] if res is not None else [Outcome.FAILED] * len(keys)

        return self._submit(len(keys), run)

    # ---- slot-level access (zero-copy for connectors) ------------------------
    def read_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                   request_id: Optional[str] = None) -> list[Outcome]:
        """Leases `keys` (in parts, ucm/service/client/slots.py) and calls
        `fill(first, slots, arena)` while they are held: `slots[i]` is the
        (offset, length) of keys[first + i] in the mapped arena, or None when
        it is missing or its length is not sizes[first + i]. The caller copies
        straight out of the arena (e.g. with _native.copy_spans), so a block
        is copied once. Synchronous; faults are outcomes, never exceptions."""
        keys = _keys(keys)
        sizes = check_sizes(keys, sizes)
        rid = check_request_id(request_id)
        return client_slots.read_slots(self, keys, sizes, fill, rid)

    def read_ranges(self, keys: Sequence[Key], offsets: Sequence[Sequence[int]], dsts: Sequence[Sequence[Any]],
                    request_id: Optional[str] = None) -> list[RangeRead]:
        """CacheAPI.read_ranges: leases and copies the ranges out; blocks below
        the landing tier are staged whole (client_slots.read_ranges)."""
        keys = _keys(keys)
        offsets, views = check_ranges(keys, offsets, dsts)
        return client_slots.read_ranges(self, keys, offsets, views, check_request_id(request_id))

    def stream_slots(self, keys: Sequence[Key], sizes: Sequence[int], layers: int,
                     request_id: Optional[str] = None) -> Any:
        """The streamed load (ucm.layer_stream.LayerStreams) through the
        service: ucm/service/client/stream.py."""
        from ucm.service.client.stream import stream_slots

        return stream_slots(self, keys, sizes, layers, request_id)

    def write_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                    parent: Optional[Key] = None, request_id: Optional[str] = None) -> list[Outcome]:
        """Reserves slots for `keys` and calls `fill(first, slots, arena)`:
        `slots[i]` is the (offset, length) to fill for keys[first + i], or None
        when the block is already cached or was refused; then commits. The
        store half of read_slots; a `fill` that raises aborts its part.
        Pipelined: ucm/service/client/slots.py."""
        keys = _keys(keys)
        sizes = check_sizes(keys, sizes)
        parent = check_parent(parent)
        rid = check_request_id(request_id)
        return client_slots.write_slots(self, keys, sizes, fill, parent, rid)

    def _slots(self, link: Link, reply: Any, n: int, width: int) -> list:
        """The per-key entries of a reserve/acquire reply, checked to be for
        this link's arena: the reply's epoch is the link's and every slot
        lies inside the arena. Raises ServiceUnavailable otherwise."""
        if not (isinstance(reply, dict) and reply.get("epoch") == link.epoch
                and isinstance(reply.get("slots"), list) and len(reply["slots"]) == n):
            raise ServiceUnavailable(f"ucm service at {self.path}: slots for another arena or malformed "
                                     f"(epoch {reply.get('epoch') if isinstance(reply, dict) else None!r}, "
                                     f"link epoch {link.epoch})")
        size = len(link.arena.m)
        for s in reply["slots"]:
            if isinstance(s, list):
                ok = len(s) == width and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
                off, length = (s[width - 2], s[width - 1]) if ok else (-1, 0)
                if not (ok and 0 <= off and 0 < length and off + length <= size):
                    raise ServiceUnavailable(f"ucm service at {self.path}: slot {s!r:.60} outside the "
                                             f"{size}-byte arena")
        return reply["slots"]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._link is not None:
                self._retire_locked(self._link)
        self._pool.shutdown(wait=True)  # copies in flight end, and their links close
        with self._lock:
            if self._kept is not None:
                self._unmap_locked(self._kept)
                self._kept = None

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- data path ---------------------------------------------------------
    def _submit(self, n: int, fn: Any, *args: Any) -> Handle:
        """`fn(*args)` on the copy pool; a bug that raises is FAILED per
        block and logged, never an exception into the engine."""
        name = getattr(fn, "__name__", repr(fn))
        if self._closed:
            raise ClosedError("CacheClient used after close()")
        return submit(self._pool, n, fn, *args,
                      on_error=lambda exc: log.error("ucm client: %s failed", name, exc_info=exc))

    def _store(self, keys: list[bytes], views: list[memoryview], parent: Optional[bytes],
               request_id: Optional[str]) -> list[Outcome]:
        def fill(first: int, slots: list, arena: Any) -> None:
            m = memoryview(arena)
            for i, slot in enumerate(slots):
                if slot is not None:
                    _native.copy(m[slot[0]:slot[0] + slot[1]], views[first + i])

        return self.write_slots(keys, [len(v) for v in views], fill, parent, request_id)

    def _chunks(self, sizes: Sequence[int], part_bytes: Optional[int] = None,
                arena_bytes: Optional[int] = None) -> list[tuple[int, int]]:
        """Index ranges of at most 1/8 of the arena (`arena_bytes`: the link's;
        else the last service's, none before a first connection: one block a
        range) and `part_bytes` each, at least one block each, so that one
        request never needs more slots than the arena has."""
        budget = max(1, (arena_bytes or int(self.service_info.get("arena_bytes", 0))) // 8)
        if part_bytes is not None:
            budget = min(budget, part_bytes)
        return cut_parts(sizes, budget)

    def _load(self, keys: list[bytes], views: list[memoryview], request_id: Optional[str]) -> list[Outcome]:
        def fill(first: int, slots: list, arena: Any) -> None:
            m = memoryview(arena)
            for i, slot in enumerate(slots):
                if slot is not None:
                    _native.copy(views[first + i], m[slot[0]:slot[0] + slot[1]])

        return self.read_slots(keys, [len(v) for v in views], fill, request_id)


def _keys(keys: Sequence[Key]) -> list[bytes]:
    return list(check_keys(keys))


def _views(keys: list[bytes], bufs: Sequence[Any], writable: bool) -> list[memoryview]:
    if len(keys) != len(bufs):
        raise ArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
    views = [byte_view(b, writable=writable, what="destination" if writable else "source") for b in bufs]
    if any(len(v) == 0 for v in views):
        raise ArgumentError("buffers must not be empty")
    return views
