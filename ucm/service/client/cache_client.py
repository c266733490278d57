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

The client is made of parts, each an object or module with a public
interface: its `Connection` (ucm/service/client/conn.py), which builds,
publishes and retires links (`Link`, ucm/service/client/link.py) and
carries every request; the pipelined slot calls (slots.py) and the
streamed loads (stream.py), which use the connection only through its
public methods. A link is built whole before it is published: its
socket, the service's `hello` (pid, epoch, arena identity), the arena
mapping, the key index mapping and the liveness poll. Any error on the
way (an unopenable or unmappable arena, EMFILE, ENOMEM, a refused hello)
is "service unavailable", and the previous state stays as it was. Every slot
handed out over a link is filled only through that link's own arena, and
only when the reply carries the link's epoch and lies inside the arena;
its commit or release goes over the same link. A link that fails while
copies into or out of its slots are still running is retired but its
socket stays open until the last of them ends, so the service cannot hand
those slots to anyone else mid-copy (the service gives back what a
connection held only when it closes).

Thread-safe: the connection's lock serialises requests on the socket and
guards the links, their in-flight counts and the mappings; copies run
outside it (on a small pool that completes the Handles, or on the
caller's thread for read_slots / write_slots); lookups read the service's
shared key index under the connection's index lock. Lock order: the lock,
then the index lock (both inside Connection; this class takes neither).
"""
from __future__ import annotations

import logging
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from ucm import _native
from ucm.api import (Handle, Key, Outcome, RangeRead, SlotFn, check_blocks, check_keys, check_output_tokens,
                     check_parent, check_ranges, check_request_id, check_sizes, check_timeout, submit)
from ucm.buffers import byte_view
from ucm.codecs.layout import KvLayout
from ucm.config.schema import UcmConfig
from ucm.errors import ArgumentError, ClosedError
from ucm.service.client import slots as client_slots
from ucm.service.client import stream as client_stream
from ucm.service.client.conn import Connection
from ucm.service.client.link import Link, ServiceUnavailable

__all__ = ["CacheClient", "ServiceUnavailable"]

log = logging.getLogger(__name__)

DESCRIBE_BATCH = 512  # block descriptions per frame (about 1 KiB each for 256 tokens)


class CacheClient:
    def __init__(self, path: str, config: Optional[UcmConfig] = None, io_workers: int = 2,
                 retry_s: float = 0.5, connect: bool = True, use_index: bool = True,
                 socket_factory: Optional[Callable[[], socket.socket]] = None) -> None:
        """`socket_factory` makes the connection's socket (a Unix stream
        socket by default); tests wrap a real socket through it to observe
        the requests or inject faults."""
        self.path = path
        self.config = config or UcmConfig()
        svc = self.config.service
        self._conn = Connection(path, socket_factory or (lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
                                timeout_s=svc.request_timeout_s, max_frame_bytes=svc.max_frame_bytes,
                                spin_s=svc.poll_spin_us / 1e6, retry_s=retry_s, use_index=use_index)
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="ucm-client")
        self.spawned: Optional[subprocess.Popen] = None
        if connect:
            self._conn.try_connect()

    # ---- the connection ------------------------------------------------------
    @property
    def connection(self) -> Connection:
        """The connection to the service (ucm/service/client/conn.py): raw
        requests (`call`) and its state, for tools and tests."""
        return self._conn

    @property
    def connected(self) -> bool:
        return self._conn.connected

    @property
    def reads_index(self) -> bool:
        """Whether lookups are answered from the service's shared key index
        (no round trip) on the current connection."""
        return self._conn.reads_index

    @property
    def service_info(self) -> dict[str, Any]:
        """The `hello` of the last service reached (empty before the first)."""
        return self._conn.service_info

    def try_connect(self) -> bool:
        """Connects now unless connected (no `retry_s` back-off): whether a
        connection is up. Never raises for an unavailable service."""
        return self._conn.try_connect()

    # ---- ucm.api.CacheAPI ----------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        keys = _keys(keys)
        if not keys:
            return 0
        n = self._conn.lookup_index(keys)  # no round trip (and no wait for another thread's request)
        return n if n is not None else self._try("lookup", {"keys": keys}, 0)

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
        if self._conn.add_layout(data):
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

    # The block catalog (KV events). A fault answers "available": False: the
    # reader cannot tell what the service holds (ucm.connectors.kv_events).
    def describe(self, blocks: Sequence[Any]) -> None:
        blocks = check_blocks(blocks)
        for i in range(0, len(blocks), DESCRIBE_BATCH):
            self._try("describe", {"blocks": [list(b) for b in blocks[i:i + DESCRIBE_BATCH]]}, None)

    def events(self, since: int, epoch: Optional[int], limit: int = 256) -> dict:
        return self._try("events", {"since": int(since), "epoch": epoch, "limit": int(limit)},
                         {"available": False, "epoch": None, "next": 0, "events": [], "reset": True})

    def holdings(self, offset: int, limit: int = 256) -> dict:
        return self._try("holdings", {"offset": int(offset), "limit": int(limit)},
                         {"available": False, "blocks": [], "next_offset": 0, "done": True})

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
        return client_slots.read_slots(self._conn, keys, sizes, fill, rid)

    def read_ranges(self, keys: Sequence[Key], offsets: Sequence[Sequence[int]], dsts: Sequence[Sequence[Any]],
                    request_id: Optional[str] = None) -> list[RangeRead]:
        """CacheAPI.read_ranges: leases and copies the ranges out; blocks below
        the landing tier are staged whole (client_slots.read_ranges)."""
        keys = _keys(keys)
        offsets, views = check_ranges(keys, offsets, dsts)
        return client_slots.read_ranges(self._conn, keys, offsets, views, check_request_id(request_id))

    def stream_slots(self, keys: Sequence[Key], sizes: Sequence[int], layers: int,
                     request_id: Optional[str] = None) -> Any:
        """The streamed load (ucm.layer_stream.LayerStreams) through the
        service: ucm/service/client/stream.py. Faults are misses, never
        exceptions."""
        keys = _keys(keys)
        sizes = check_sizes(keys, sizes)
        rid = check_request_id(request_id)
        # The chunks are cut by the arena its hello announced (none before a first connection).
        live = self._conn.try_live()
        spans = self._chunks(sizes, arena_bytes=live.info.get("arena_bytes") if live is not None else None)
        return client_stream.stream_slots(self._conn, keys, sizes, layers, rid, spans, self._begin_fill)

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
        return client_slots.write_slots(self._conn, keys, sizes, fill, parent, rid)

    def close(self) -> None:
        if not self._conn.close():
            return
        self._pool.shutdown(wait=True)  # copies in flight end, and their links close
        self._conn.unmap_kept()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- data path ---------------------------------------------------------
    def _submit(self, n: int, fn: Any, *args: Any) -> Handle:
        """`fn(*args)` on the copy pool; a bug that raises is FAILED per
        block and logged, never an exception into the engine."""
        name = getattr(fn, "__name__", repr(fn))
        if self._conn.closed:
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

    def _load(self, keys: list[bytes], views: list[memoryview], request_id: Optional[str]) -> list[Outcome]:
        def fill(first: int, slots: list, arena: Any) -> None:
            m = memoryview(arena)
            for i, slot in enumerate(slots):
                if slot is not None:
                    _native.copy(views[first + i], m[slot[0]:slot[0] + slot[1]])

        return self.read_slots(keys, [len(v) for v in views], fill, request_id)

    def _chunks(self, sizes: Sequence[int], part_bytes: Optional[int] = None,
                arena_bytes: Optional[int] = None) -> list[tuple[int, int]]:
        """client_slots.arena_parts of the arena `arena_bytes` (the link's;
        else the last service's, none before a first connection: one block a
        range)."""
        arena = arena_bytes or int(self.service_info.get("arena_bytes", 0))
        return client_slots.arena_parts(sizes, arena, part_bytes)

    def _begin_fill(self, op: str, args: dict) -> tuple[Link, Any]:
        """Connection.begin_fill: how stream_slots sends each chunk's request."""
        return self._conn.begin_fill(op, args)

    # ---- requests ------------------------------------------------------------
    def _try(self, op: str, args: dict, default: Any) -> Any:
        """Connection.try_call: `default` for a fault, never an exception."""
        return self._conn.try_call(op, args, default)


def _keys(keys: Sequence[Key]) -> list[bytes]:
    return list(check_keys(keys))


def _views(keys: list[bytes], bufs: Sequence[Any], writable: bool) -> list[memoryview]:
    if len(keys) != len(bufs):
        raise ArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
    views = [byte_view(b, writable=writable, what="destination" if writable else "source") for b in bufs]
    if any(len(v) == 0 for v in views):
        raise ArgumentError("buffers must not be empty")
    return views
