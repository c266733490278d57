"""Streamed loads through the service: the client half (CacheClient.stream_slots).

The client asks `stream` over its connection, one request per chunk of at
most 1/8 of the arena (read_slots cuts finer parts, ucm/service/client/slots.py); each reply carries the slots and
where the chunk's progress words lie in the service's progress file
(ucm/service/progress.py), which the client maps read-only once per
service instance. Waits poll those words (a short sleep between looks) and
look every millisecond whether the service hung up: a dead service makes
every block that has not finished a miss at once, and every wait is
bounded by its timeout. The connection counts the stream as a copy in
flight until `release`, so its socket (whose closing gives the slots back)
stays open while the engine copies out of them.

Requests, mappings and the in-flight count go through the client's
`Connection` (ucm/service/client/conn.py) and its public methods, each of
which takes the connection's lock for as long as it runs; waits take none.
The keys and sizes come checked, and the chunks cut, from the client
(CacheClient.stream_slots).
"""
from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Any, Callable, Optional, Sequence

from ucm.api import Outcome
from ucm.errors import ClosedError, UcmError
from ucm.layer_stream import FAILED, LayerStream, WordView, word_count
from ucm.service.client.conn import Connection
from ucm.service.client.link import Link, ServiceUnavailable, hung_up

log = logging.getLogger(__name__)

POLL_SLEEP_S = 0.00005
HANGUP_CHECK_S = 0.001


class _Part:
    __slots__ = ("link", "sid", "first", "n", "view", "ident", "dead")

    def __init__(self, link: Link, sid: Optional[int], first: int, n: int, view: Optional[WordView],
                 ident: Optional[tuple]) -> None:
        self.link, self.sid, self.first, self.n = link, sid, first, n
        self.view, self.ident = view, ident
        self.dead = view is None  # refused or gone: every block a miss


class ClientStream(LayerStream):
    """A stream served by the service; see the module docstring."""

    def __init__(self, conn: Connection, arena: Any, n: int, layers: int) -> None:
        self._conn = conn
        self.arena = arena
        self.layers = layers
        self.slots: list[Optional[tuple[int, int]]] = [None] * n
        self.parts: list[_Part] = []
        self._released = False

    def _poll(self, part: _Part, ready: Any, timeout_s: float) -> Any:
        """ready(view) until it is not None, the service hung up, or the
        timeout; None for the two last."""
        if part.dead:
            return None
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + HANGUP_CHECK_S
        while True:
            got = ready(part.view)
            if got is not None:
                return got
            now = time.monotonic()
            if now >= next_check:
                if hung_up(part.link):
                    part.dead = True
                    log.warning("ucm client: the service went away during a streamed load; its blocks are misses")
                    return None
                next_check = now + HANGUP_CHECK_S
            if now >= deadline:
                return None
            time.sleep(POLL_SLEEP_S)

    def wait_layer(self, layer: int, timeout_s: float) -> list[bool]:
        deadline = time.monotonic() + timeout_s
        out: list[bool] = []
        for part in self.parts:
            got = self._poll(part, lambda v: v.landed(layer), max(0.0, deadline - time.monotonic()))
            if got is None:  # late or gone: only what had landed (the words never run ahead of the bytes)
                got = [False] * part.n if part.dead else [
                    part.view.words[i] != FAILED and part.view.words[i] > layer for i in range(part.n)]
            out.extend(got)
        return out

    def outcomes(self, timeout_s: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout_s
        out: list[Outcome] = []
        for part in self.parts:
            ok = self._poll(part, lambda v: True if v.finished() else None, max(0.0, deadline - time.monotonic()))
            out.extend(part.view.final() if ok else [Outcome.FAILED] * part.n)
        return out

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        for part in self.parts:
            if part.view is not None:
                part.view.words.release()
                part.view = None
            if part.link is not None:
                self._conn.end_fill(part.link, "stream_release" if part.sid is not None else None,
                                    {"sid": part.sid})
            if part.ident is not None:
                self._conn.unmap(part.ident)


def map_progress(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise UcmError(f"progress file {path!r} is smaller than the {size} bytes announced")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def stream_slots(conn: Connection, keys: list[bytes], sizes: Sequence[int], layers: int,
                 request_id: Optional[str], spans: Sequence[tuple[int, int]],
                 begin_fill: Callable[[str, dict], tuple[Link, Any]]) -> ClientStream:
    """CacheClient.stream_slots over `conn`: one `stream` request per chunk
    of `spans`, each sent by `begin_fill` (the client's way to
    Connection.begin_fill), which counts the chunk as a copy in flight until
    `release`. Faults are misses, never exceptions."""
    stream: Optional[ClientStream] = None
    for i, j in spans:
        n = j - i
        try:
            link, reply = begin_fill("stream", {"keys": keys[i:j], "sizes": list(sizes[i:j]),
                                                "layers": layers, "request_id": request_id})
        except UcmError as exc:
            if isinstance(exc, ClosedError):
                raise
            log.debug("%s", exc)
            if stream is None:
                stream = ClientStream(conn, None, len(keys), layers)
            stream.parts.append(_Part(None, None, i, n, None, None))  # type: ignore[arg-type]
            continue
        if stream is None:
            stream = ClientStream(conn, link.arena.m, len(keys), layers)
        elif stream.arena is None:  # the chunks before were refused: this one's arena serves
            stream.arena = link.arena.m
        part = _Part(link, reply.get("sid") if isinstance(reply, dict) else None, i, n, None, None)
        stream.parts.append(part)
        try:
            if link.arena.m is not stream.arena:
                raise ServiceUnavailable("a streamed load's chunks came from two service instances")
            slots = link.check_slots(reply, n, 2)
            at = reply.get("words")
            info = link.info
            size = int(info.get("progress_bytes") or 0)
            if not (isinstance(at, int) and size and 0 <= at and (at + word_count(n)) * 4 <= size):
                raise ServiceUnavailable(f"stream: progress words at {at!r} outside the {size}-byte file")
            ident = ("progress", info["progress_path"], link.epoch)
            mapping = conn.map(ident, lambda: map_progress(info["progress_path"], size))
            part.ident = ident
            words = memoryview(mapping.m).cast("I")[at:at + word_count(n)]
            part.view = WordView(words, n, layers)
            part.dead = False
            for k, s in enumerate(slots):
                stream.slots[i + k] = (s[0], s[1]) if isinstance(s, list) else None
        except (UcmError, OSError, KeyError, TypeError, ValueError) as exc:
            log.warning("ucm client: a streamed load's reply was unusable: %s", exc)
            part.dead = True
    if stream is None:
        stream = ClientStream(conn, None, 0, layers)
    return stream
