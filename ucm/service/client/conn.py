"""The connection side of a CacheClient (ucm/service/client/cache_client.py): build a
link, publish it, retire it, send requests over it and turn its faults
into ServiceUnavailable.

`ClientConnection` is a mixin of CacheClient, as the nvme adapter's read
path is of NvmeAdapter: its state is the client's, set in
`CacheClient.__init__` (`path`, `_socket_factory`, `_timeout`, `_limit`,
`_spin_s`, `_retry_s`, `_use_index`, `_lock`, `_index_lock`, `_link`,
`_maps`, `_kept`, `_layouts`, `_rid`, `_next_try`, `_closed`,
`service_info`), and the rules are the client module's: a link is built
whole before it is published, any error on the way is "service
unavailable" and leaves the previous state as it was; a link that fails
while copies into or out of its slots still run is retired, and its
socket stays open until the last of them ends. Methods named `_locked`
run under `_lock`; lock order `_lock`, then `_index_lock`.
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

from ucm.config.schema import UcmConfig
from ucm.errors import ArgumentError, ClosedError, UcmError
from ucm.service import protocol as proto
from ucm.service.client.link import Link, Mapping, Pending, ServiceUnavailable, exchange, hung_up, map_arena
from ucm.service.index import map_index

log = logging.getLogger(__name__)


# Errors a connection attempt can meet that mean "no usable service now".
_CONNECT_ERRORS = (OSError, ValueError, KeyError, TypeError, OverflowError, UcmError)


class ClientConnection:
    """Connecting, requests and faults of CacheClient; see the module docstring."""

    path: str
    config: UcmConfig
    service_info: dict[str, Any]
    _socket_factory: Callable[[], socket.socket]
    _timeout: float
    _limit: int
    _spin_s: float
    _retry_s: float
    _use_index: bool
    _lock: threading.Lock
    _index_lock: threading.Lock
    _link: Optional[Link]
    _maps: dict[tuple, Mapping]
    _kept: Optional[tuple]
    _layouts: list[bytes]
    _rid: int
    _next_try: float
    _closed: bool

    @property
    def connected(self) -> bool:
        return self._link is not None

    def try_connect(self) -> bool:
        """Connects now unless connected (no `retry_s` back-off): whether a
        connection is up. Never raises for an unavailable service."""
        with self._lock:
            if self._closed:
                raise ClosedError("CacheClient used after close()")
            if self._link is None:
                try:
                    self._connect_locked()
                except ServiceUnavailable:
                    return False
            return True

    @property
    def reads_index(self) -> bool:
        """Whether lookups are answered from the service's shared key index
        (no round trip) on the current connection."""
        link = self._link
        return link is not None and link.index is not None

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
        self.service_info = info
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
        """Sends `op` over `link` without waiting for its reply (see
        ucm.service.client.link); a fault retires the link."""
        with self._faults(link, op):
            return link.send(self._next_rid(), op, args, detached)

    def _wait_locked(self, link: Link, p: Pending) -> Any:
        """The reply to `p`; a fault retires the link, a refusal raises
        UcmError."""
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

    def _call(self, op: str, args: dict) -> Any:
        with self._lock:
            return self._request_locked(self._live_locked(), op, args)

    def _begin_fill(self, op: str, args: dict) -> tuple[Link, Any]:
        """Sends `op` (reserve or acquire) and counts a copy in flight on the
        link that answered; `_end_fill` must follow."""
        with self._lock:
            link = self._live_locked()
            reply = self._request_locked(link, op, args)
            link.inflight += 1
            return link, reply

    def _end_fill(self, link: Link, op: Optional[str], args: dict) -> Any:
        """Ends a copy begun by `_begin_fill` and sends `op` (commit, abort or
        release) over the same link. None when that link is gone: the
        service then gives the slots back when the link's socket closes."""
        with self._lock:
            link.inflight -= 1
            result = None
            if op is not None and not link.dead:
                try:
                    result = self._request_locked(link, op, args)
                except ServiceUnavailable as exc:
                    log.debug("%s", exc)
                except UcmError as exc:
                    log.warning("%s", exc)
            if link.dead and link.inflight == 0:
                self._close_link_locked(link)
            return result

    def _try(self, op: str, args: dict, default: Any) -> Any:
        try:
            return self._call(op, args)
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
