"""One connection of a CacheClient to one service instance, and its replies.

A `Link` is the socket, the service's `hello`, the arena and key index
mappings it announced and the liveness poll, built whole by the client's
`Connection` (ucm/service/client/conn.py) before it is published.

Requests may be pipelined: `send` writes a request and queues a `Pending`
for it; `wait` reads replies until that request's has come. The service
answers the requests of one connection in order, one at a time, so the
replies arrive in the order of the queue: whoever waits files every reply
it reads under the request at the head (its own, or another thread's, or
a detached one nobody waits for, such as a `release`). This lets a caller
send the reservation of its next chunk before copying the current one
(ucm/service/client/slots.py), so the service works on it meanwhile.

Not thread-safe by itself: the `Connection` holds its lock around every
`send` and `wait` (never across a copy), so a reply is read by one thread
at a time and the queue is never torn. `check_slots` reads only what is
set when the link is built and `hung_up` has a lock of its own: both run
under either of the connection's locks or none.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import select
import socket
import threading
from typing import Any, Optional

from ucm.errors import UcmError
from ucm.service import protocol as proto

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ServiceUnavailable(UcmError):
    """The service could not be reached; callers turn it into misses."""


def map_arena(path: str, size: int, inode: int) -> mmap.mmap:
    """Maps the service's arena file read-write. Refuses a file that is not
    the one the service announced (another inode, or smaller than `size`)."""
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_ino != inode or st.st_size < size:
            raise ServiceUnavailable(f"arena {path!r} is not the service's (inode {st.st_ino}, "
                                     f"{st.st_size} bytes; announced inode {inode}, {size} bytes)")
        # MAP_POPULATE: map every page now, so copies into slots take no faults.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        # MAP_POPULATE maps shared pages read-only (the first write to each
        # still faults); MADV_POPULATE_WRITE maps them writable without
        # touching their bytes (Linux 5.14+; older kernels refuse it).
        m.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        pass
    return m


class Mapping:
    """A shared mapping (arena or key index) used by one or more links."""

    __slots__ = ("m", "refs")

    def __init__(self, m: mmap.mmap) -> None:
        self.m = m
        self.refs = 0


class Pending:
    """A request sent over a link whose reply may not have been read yet.
    `detached`: nobody waits for it (a refusal is logged when it is read)."""

    __slots__ = ("rid", "op", "detached", "done", "ok", "value")

    def __init__(self, rid: int, op: str, detached: bool) -> None:
        self.rid, self.op, self.detached = rid, op, detached
        self.done = False
        self.ok = False
        self.value: Any = None


def exchange(sock: socket.socket, reader: proto.FrameReader, rid: int, op: str, args: dict,
             spin_s: float, path: str) -> Any:
    """One request and its reply on a socket nothing else is using (the
    connection being built). Raises on any fault."""
    sock.sendall(proto.pack([rid, op, args]))
    return _result(op, _checked(reader.read(spin_s), rid, op, path), path)


def _checked(frame: Any, rid: int, op: str, path: str) -> list:
    if frame is None:
        raise ServiceUnavailable(f"ucm service at {path} closed the connection during {op}")
    if not (isinstance(frame, list) and len(frame) == 3 and frame[0] == rid):
        raise ServiceUnavailable(f"ucm service at {path} sent a malformed reply to {op}")
    return frame


def _result(op: str, frame: list, path: str) -> Any:
    if not frame[1]:
        raise UcmError(f"ucm service refused {op}: {frame[2]}")
    return frame[2]


class Link:
    """One connection to one service instance, with the arena and key index
    that instance announced. `inflight` counts copies running into or out
    of slots handed out over it; `dead` means no new request goes over it;
    `pending` the requests sent whose replies were not read yet, in order."""

    __slots__ = ("sock", "reader", "info", "epoch", "arena", "arena_id", "index", "index_id", "poll",
                 "inflight", "dead", "pending", "path", "poll_lock")

    def __init__(self, sock: socket.socket, reader: proto.FrameReader, info: dict, arena: Mapping,
                 arena_id: tuple, index: Optional[Mapping], index_id: Optional[tuple],
                 poll: select.poll, path: str) -> None:
        self.sock, self.reader, self.info = sock, reader, info
        self.epoch = info["epoch"]
        self.arena, self.arena_id = arena, arena_id
        self.index, self.index_id = index, index_id
        self.poll = poll
        self.poll_lock = threading.Lock()  # a poll object refuses two poll() calls at once
        self.inflight = 0
        self.dead = False
        self.pending: "collections.deque[Pending]" = collections.deque()
        self.path = path

    def send(self, rid: int, op: str, args: dict, detached: bool = False) -> Pending:
        """Writes request `rid` and queues its Pending. Raises OSError (or
        ServiceUnavailable on a dead link)."""
        if self.dead:
            raise ServiceUnavailable(f"ucm service at {self.path}: the connection is gone ({op})")
        p = Pending(rid, op, detached)
        self.pending.append(p)
        try:
            self.sock.sendall(proto.pack([rid, op, args]))
        except BaseException:
            self.pending.pop()
            raise
        return p

    def wait(self, p: Pending, spin_s: float) -> Any:
        """`p`'s result, reading (and filing) the replies before it. Raises
        ServiceUnavailable, OSError or ProtocolError on a fault (the link is
        then unusable), UcmError when the service refused the request."""
        while not p.done:
            if self.dead or not self.pending:
                raise ServiceUnavailable(f"ucm service at {self.path}: the connection is gone ({p.op})")
            head = self.pending[0]
            frame = _checked(self.reader.read(spin_s), head.rid, head.op, self.path)
            self.pending.popleft()
            head.done, head.ok, head.value = True, bool(frame[1]), frame[2]
            if head.detached and not head.ok:
                log.warning("ucm service refused %s: %s", head.op, head.value)
        return _result(p.op, [p.rid, p.ok, p.value], self.path)

    def check_slots(self, reply: Any, n: int, width: int) -> list:
        """The per-key entries of a reserve/acquire/stream reply, checked to
        be for this link's arena: the reply's epoch is the link's and every
        slot (an entry of `width` integers ending in offset and length) lies
        inside the arena. Raises ServiceUnavailable otherwise."""
        if not (isinstance(reply, dict) and reply.get("epoch") == self.epoch
                and isinstance(reply.get("slots"), list) and len(reply["slots"]) == n):
            raise ServiceUnavailable(f"ucm service at {self.path}: slots for another arena or malformed "
                                     f"(epoch {reply.get('epoch') if isinstance(reply, dict) else None!r}, "
                                     f"link epoch {self.epoch})")
        size = len(self.arena.m)
        for s in reply["slots"]:
            if isinstance(s, list):
                ok = len(s) == width and all(isinstance(v, int) and not isinstance(v, bool) for v in s)
                off, length = (s[width - 2], s[width - 1]) if ok else (-1, 0)
                if not (ok and 0 <= off and 0 < length and off + length <= size):
                    raise ServiceUnavailable(f"ucm service at {self.path}: slot {s!r:.60} outside the "
                                             f"{size}-byte arena")
        return reply["slots"]


def hung_up(link: Link) -> bool:
    """Whether the service closed its end of `link` (it exited or was killed).
    Any thread (lookups ask it under the connection's index lock, requests
    under its lock, streamed loads under neither)."""
    with link.poll_lock:
        events = link.poll.poll(0)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in events)
