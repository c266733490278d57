"""A CacheClient's connection to the service: build a link, publish it,
retire it, send requests over it, count the copies running into or out of
its slots, and turn its faults into ServiceUnavailable.

`Connection` is an object of its own. The client (cache_client.py), its
slot data plane (slots.py) and its streamed loads (stream.py) use it only
through the public methods below; each takes the connection's lock for as
long as it runs and never holds it across a copy, so callers never take
it themselves. The rules are the client module's: a link is built whole
before it is published, any error on the way is "service unavailable" and
leaves the previous state as it was; a link that fails while copies into
or out of its slots still run is retired, and its socket stays open until
the last of them ends (`end_fill`).

Thread-safe: `_lock` serialises requests on the socket and guards the
links, their in-flight counts and the mappings (methods named `_locked`
run under it); lookups read the current link and its key index under
`_index_lock`. Lock order: `_lock`, then `_index_lock`.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import select
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional

from ucm import _native
from ucm.errors import ArgumentError, ClosedError, UcmError
from ucm.service import protocol as proto
from ucm.service.client.link import Link, Mapping, Pending, ServiceUnavailable, exchange, hung_up, map_arena
from ucm.service.index import map_index

log = logging.getLogger(__name__)


# Errors a connection attempt can meet that mean "no usable service now".
_CONNECT_ERRORS = (OSError, ValueError, KeyError, TypeError, OverflowError, UcmError)


class Connection:
    """One client's connection to the service at `path`, re-made after a
    fault; see the module docstring. Any thread may call any method."""

    def __init__(self, path: str, socket_factory: Callable[[], socket.socket], timeout_s: float,
                 max_frame_bytes: int, spin_s: float, retry_s: float, use_index: bool) -> None:
        """`socket_factory` makes each link's socket; `timeout_s` bounds a
        request; `retry_s` is the least time between connection attempts
        after a fault; `use_index`: answer lookups from the service's shared
        key index when it announces one."""
        self.path = path
        self._socket_factory = socket_factory
        self._timeout = timeout_s
        self._limit = max_frame_bytes
        self._spin_s = spin_s
        self._retry_s = retry_s
        self._use_index = use_index  # False: every lookup is a request over the socket
        self._lock = threading.Lock()  # one request at a time on the socket; links and mappings
        self._index_lock = threading.Lock()  # lookups reading the current link's index
        self._link: Optional[Link] = None
        self._maps: dict[tuple, Mapping] = {}  # arena, index and progress mappings by identity
        self._kept: Optional[tuple] = None  # the last arena, kept mapped for a reconnect to it
        self._info: dict[str, Any] = {}
        self._rid = 0
        self._layouts: list[bytes] = []  # registered KV layouts, sent again on every new connection
        self._next_try = 0.0
        self._closed = False

    # ---- state -------------------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        """The lock every request on the socket holds (no lookup from the key
        index does). Holding it keeps requests out; it is not reentrant, so
        its holder calls no method of this connection meanwhile."""
        return self._lock

    @property
    def connected(self) -> bool:
        return self._link is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def reads_index(self) -> bool:
        """Whether lookups are answered from the service's shared key index
        (no round trip) on the current link."""
        link = self._link
        return link is not None and link.index is not None

    @property
    def service_info(self) -> dict[str, Any]:
        """The `hello` of the last service reached (empty before the first)."""
        return self._info

    # ---- connecting --------------------------------------------------------
    def try_connect(self) -> bool:
        """Connects now unless connected (no `retry_s` back-off): whether a
        link is up. Never raises for an unavailable service."""
        with self._lock:
            if self._closed:
                raise ClosedError("CacheClient used after close()")
            if self._link is None:
                try:
                    self._connect_locked()
                except ServiceUnavailable:
                    return False
            return True

    def live(self) -> Link:
        """The current link, connecting first when there is none (at most
        every `retry_s` after a fault). Raises ServiceUnavailable, or
        ClosedError after `close`."""
        with self._lock:
            return self._live_locked()

    def try_live(self) -> Optional[Link]:
        """`live`, or None when the service is unavailable (logged). Raises
        ClosedError after `close`."""
        try:
            return self.live()
        except ClosedError:
            raise
        except UcmError as exc:
            log.debug("%s", exc)
            return None

    def add_layout(self, layout: bytes) -> bool:
        """Remembers an encoded KV layout, sent again on every new link;
        whether it was new (then the caller sends it on the current one)."""
        with self._lock:
            if layout in self._layouts:
                return False
            self._layouts.append(layout)
            return True

    def close(self) -> bool:
        """No request goes out from now on; the current link is retired (its
        socket closes once no copy runs). Whether it was open. `unmap_kept`
        follows once the copies in flight have ended."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            if self._link is not None:
                self._retire_locked(self._link)
            return True

    def unmap_kept(self) -> None:
        """Unmaps the arena kept for a reconnect (after `close`)."""
        with self._lock:
            if self._kept is not None:
                self._unmap_locked(self._kept)
                self._kept = None

    # ---- requests ----------------------------------------------------------
    def call(self, op: str, args: dict) -> Any:
        """One request over the live link and its reply. Raises
        ServiceUnavailable (the link is retired), UcmError when the service
        refused it (the link stays), ClosedError after `close`."""
        with self._lock:
            return self._request_locked(self._live_locked(), op, args)

    def try_call(self, op: str, args: dict, default: Any) -> Any:
        """`call`, with `default` for an unavailable service, a refusal or a
        bug (logged): a cache fault is never an exception into the engine.
        Misuse (ClosedError, ArgumentError) raises."""
        try:
            return self.call(op, args)
        except (ClosedError, ArgumentError):
            raise
        except ServiceUnavailable as exc:
            log.debug("%s", exc)
            return default
        except UcmError as exc:
            log.warning("%s", exc)
            return default
        except Exception:  # a cache fault is never an exception into the engine
            log.exception("ucm client: %s failed", op)
            return default

    def send(self, link: Link, op: str, args: dict, detached: bool = False) -> Pending:
        """Sends `op` over `link` without waiting for its reply (see
        ucm.service.client.link; `detached`: nobody will wait for it). A
        fault retires the link and raises ServiceUnavailable."""
        with self._lock:
            return self._send_locked(link, op, args, detached)

    def wait(self, link: Link, p: Pending) -> Any:
        """The reply to `p`, sent over `link`. A fault retires the link and
        raises ServiceUnavailable; a refusal raises UcmError."""
        with self._lock:
            return self._wait_locked(link, p)

    def lookup_index(self, keys: list[bytes]) -> Optional[int]:
        """The answer from the shared key index, or None to ask the service:
        no index, no live link, an inconsistent read, or a partial hit that
        blocks other nodes put into a shared tier might extend."""
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

    # ---- copies into and out of slots ----------------------------------------
    def begin_fill(self, op: str, args: dict) -> tuple[Link, Any]:
        """Sends `op` (reserve, acquire or stream) over the live link, waits
        for its reply and counts a copy in flight on that link; `end_fill`
        must follow. Raises as `call` does."""
        with self._lock:
            link = self._live_locked()
            reply = self._request_locked(link, op, args)
            link.inflight += 1
            return link, reply

    def claim(self, link: Link, asked: Optional[Pending], n: int, width: int) -> Optional[list]:
        """The slots of the reply to `asked` (a reserve or acquire of `n` keys
        sent ahead over `link`), checked to be in its arena, counting a copy
        in flight on `link` that `end_fill` ends; None when the request
        failed or was refused, or its link is gone (no copy is counted).
        Slots outside the arena retire the link."""
        if asked is None:
            return None
        with self._lock:
            if link.dead:  # its reply may have been filed by another thread, but the
                return None  # socket is closing (or closed): the service gave its slots back
            try:
                reply = self._wait_locked(link, asked)
            except UcmError as exc:
                log.debug("%s", exc)
                return None
            try:
                entries = link.check_slots(reply, n, width)
            except ServiceUnavailable as exc:
                log.warning("%s", exc)
                self._retire_locked(link)  # closing the link gives back what it holds
                return None
            link.inflight += 1
            return entries

    def end_fill(self, link: Link, op: Optional[str] = None, args: Optional[dict] = None, *,
                 reply: bool = False, detached: bool = False) -> Optional[Pending]:
        """Ends a copy counted by `begin_fill` or `claim` and sends `op`
        (commit, abort, release or stream_release) over the same link: waits
        for its reply unless `reply` (its Pending is returned) or `detached`
        (nobody waits for it). None when the link is gone: the service then
        gives the slots back when its socket closes, which happens here once
        the last copy counted on a retired link has ended."""
        with self._lock:
            link.inflight -= 1
            p = None
            if op is not None and not link.dead:
                try:
                    p = self._send_locked(link, op, args or {}, detached)
                    if not (reply or detached):
                        self._wait_locked(link, p)
                except ServiceUnavailable as exc:
                    log.debug("%s", exc)
                    p = None
                except UcmError as exc:
                    log.warning("%s", exc)
            if link.dead and link.inflight == 0:
                self._close_link_locked(link)
            return p if reply else None

    # ---- mappings ----------------------------------------------------------
    def map(self, ident: tuple, make: Callable[[], mmap.mmap]) -> Mapping:
        """The shared mapping `ident` (made by `make` when none is), counted
        once more; `unmap` gives the count back."""
        with self._lock:
            return self._map_locked(ident, make)

    def unmap(self, ident: tuple) -> None:
        """Gives back one count of `ident`; the last unmaps it."""
        with self._lock:
            self._unmap_locked(ident)

    # ---- under _lock -------------------------------------------------------
    def _connect_locked(self) -> Link:
        """Builds a link and publishes it, or raises ServiceUnavailable and
        leaves everything as it was."""
        sock: Optional[socket.socket] = None
        held: list[tuple] = []
        try:
            sock = self._socket_factory()
            sock.settimeout(self._timeout)
            sock.connect(self.path)
            reader = proto.FrameReader(sock, self._limit)
            info = exchange(sock, reader, self._next_rid(), "hello", {"version": proto.VERSION}, self._spin_s,
                            self.path)
            if not isinstance(info, dict):
                raise ServiceUnavailable(f"hello: expected a map, got {type(info).__name__}")
            epoch, size, inode = info["epoch"], info["arena_bytes"], info["arena_inode"]
            if not all(isinstance(v, int) for v in (epoch, size, inode)):
                raise ServiceUnavailable("hello: epoch, arena_bytes and arena_inode must be integers")
            for layout in list(self._layouts):  # a restarted service learns them again
                exchange(sock, reader, self._next_rid(), "layout", {"layout": layout}, self._spin_s, self.path)
            arena_id = ("arena", info["arena_path"], inode, epoch)
            arena = self._map_locked(arena_id, lambda: map_arena(info["arena_path"], size, inode))
            held.append(arena_id)
            index = index_id = None
            if info.get("index_path") and self._use_index:
                index_id = ("index", info["index_path"], epoch)
                index = self._map_locked(index_id, lambda: map_index(info["index_path"], info["index_bytes"]))
                held.append(index_id)
            poll = select.poll()
            # POLLHUP only: a reply that arrived for another thread's request
            # (POLLIN) must not look like a dead service.
            poll.register(sock, select.POLLHUP)
        except _CONNECT_ERRORS as exc:
            for ident in held:
                self._unmap_locked(ident)
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
            self._next_try = time.monotonic() + self._retry_s
            if isinstance(exc, ServiceUnavailable):
                raise
            raise ServiceUnavailable(f"no usable ucm service at {self.path}: {type(exc).__name__}: {exc}") from None
        link = Link(sock, reader, info, arena, arena_id, index, index_id, poll, self.path)
        if self._kept != arena_id:  # keep the newest arena mapped across a reconnect to it
            if self._kept is not None:
                self._unmap_locked(self._kept)
            self._map_locked(arena_id, lambda: arena.m)
            self._kept = arena_id
        with self._index_lock:
            self._link = link
        self._info = info
        return link

    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def _map_locked(self, ident: tuple, make: Callable[[], mmap.mmap]) -> Mapping:
        mapping = self._maps.get(ident)
        if mapping is None:
            mapping = self._maps[ident] = Mapping(make())
        mapping.refs += 1
        return mapping

    def _unmap_locked(self, ident: tuple) -> None:
        mapping = self._maps.get(ident)
        if mapping is None:
            return
        mapping.refs -= 1
        if mapping.refs > 0:
            return
        del self._maps[ident]
        with self._index_lock:  # no lookup is reading it
            try:
                mapping.m.close()
            except BufferError:
                pass  # a view of it is still alive; it is unmapped with the object

    def _retire_locked(self, link: Link, backoff: bool = True) -> None:
        """No new request goes over `link`; its socket closes once no copy
        into or out of its slots runs any more. `backoff`: wait `retry_s`
        before connecting again (a request failed); without it (the service
        hung up: it exited, or a new one replaced it) the next call tries at
        once, so the first lookup after a restart is not a miss."""
        if link.dead:
            return
        link.dead = True
        with self._index_lock:
            if self._link is link:
                self._link = None
        if backoff:
            self._next_try = time.monotonic() + self._retry_s
        if link.inflight == 0:
            self._close_link_locked(link)

    def _close_link_locked(self, link: Link) -> None:
        try:
            link.sock.close()  # the service gives back what this connection held
        except OSError:
            pass
        self._unmap_locked(link.arena_id)
        if link.index_id is not None:
            self._unmap_locked(link.index_id)

    def _request_locked(self, link: Link, op: str, args: dict) -> Any:
        return self._wait_locked(link, self._send_locked(link, op, args))

    def _send_locked(self, link: Link, op: str, args: dict, detached: bool = False) -> Pending:
        with self._faults(link, op):
            return link.send(self._next_rid(), op, args, detached)

    def _wait_locked(self, link: Link, p: Pending) -> Any:
        with self._faults(link, p.op):
            return link.wait(p, self._spin_s)

    @contextlib.contextmanager
    def _faults(self, link: Link, op: str) -> Iterator[None]:
        """A fault on `link` (ServiceUnavailable, OSError, an undecodable
        reply) retires it and is ServiceUnavailable; a refusal passes; any
        other exception (an interrupt) retires it and propagates."""
        try:
            yield
        except ServiceUnavailable:
            self._retire_locked(link)
            raise
        except (OSError, proto.ProtocolError) as exc:
            self._retire_locked(link)
            raise ServiceUnavailable(f"ucm service at {self.path} failed during {op}: {exc}") from None
        except UcmError:
            raise  # the service refused the request: the link is fine
        except BaseException:
            # Interrupted inside the link's own I/O (a KeyboardInterrupt in
            # sendall or in a read): how much of a frame went out or came in
            # is unknown, so the link carries no further frame. The service
            # is not at fault: the next call connects again at once.
            self._retire_locked(link, backoff=False)
            raise

    def _live_locked(self) -> Link:
        if self._closed:
            raise ClosedError("CacheClient used after close()")
        if self._link is not None and hung_up(self._link):
            self._retire_locked(self._link, backoff=False)
        if self._link is None:
            if time.monotonic() < self._next_try:
                raise ServiceUnavailable(f"ucm service at {self.path} is down")
            return self._connect_locked()
        return self._link
