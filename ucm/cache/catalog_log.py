"""The block catalog's descriptions on disk (`events.path`), so that a
restarted cache advertises the blocks a persistent tier kept.

An append-only file of records, each `length u32 | crc32 u32 | payload`,
the payload `key (16) | has_parent (1) | parent (16, if any) | tokens
length u32 | tokens | extra as JSON`. Blocks are appended as they are
described (one write per batch, so a killed process loses at most the
batch it was writing); the file is read once when the cache starts, up to
the first record that is torn, fails its checksum or does not pass
`ucm.api.check_blocks` (the rest is cut off); and it is rewritten from
the catalog's current descriptions (`rewrite`, into a new file renamed
over the old one) once it holds far more records than the catalog.

One process at a time: an exclusive lock on `path + ".lock"`; a second
process gets a warning and keeps its descriptions in memory. An OS error
(a full disk, a removed directory) turns the log off with one warning
and the catalog goes on in memory. Nothing here can make a catalog claim
a block: a loaded description is only advertised once the cache's own
`locate` finds the block in a tier, so a lost description is an
under-claim and a stale one is forgotten.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from typing import Callable, Iterable, Optional

from ucm.api import EXTRA_FIELDS, MAX_BLOCK_TOKENS, check_blocks

__all__ = ["DescriptionLog"]

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")  # payload length, crc32 of the payload
# The largest valid record: the most tokens, and every extra field at 4,096 characters that JSON
# writes as 12 bytes each (a character outside the BMP, escaped as a surrogate pair), quoted with its name.
_MAX_RECORD = 16 + 1 + 16 + 4 + 4 * MAX_BLOCK_TOKENS + len(EXTRA_FIELDS) * (12 * 4096 + 64) + 2

Block = tuple  # (key, parent, tokens, extra), as ucm.api.check_blocks returns them


def _encode(blocks: Iterable[Block]) -> bytes:
    out = bytearray()
    for key, parent, tokens, extra in blocks:
        payload = b"".join((key, b"\x01" + parent if parent is not None else b"\x00",
                            struct.pack("<I", len(tokens)), tokens,
                            json.dumps(extra, separators=(",", ":")).encode() if extra else b""))
        out += _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


def _decode(payload: bytes) -> Block:
    key = payload[:16]
    at = 17 + 16 * payload[16]
    parent = payload[17:33] if payload[16] else None
    (n,) = struct.unpack_from("<I", payload, at)
    tokens = payload[at + 4:at + 4 + n]
    rest = payload[at + 4 + n:]
    if len(key) != 16 or payload[16] > 1 or len(tokens) != n:
        raise ValueError("a torn record")
    extra = json.loads(rest) if rest else None
    return check_blocks([[key, parent, tokens, extra]])[0]


class DescriptionLog:
    """The catalog's descriptions in one file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        """Opens (creating its directory) and locks `path`; OSError when it
        cannot, BlockingIOError when another process holds it."""
        self.path = path
        self.records = 0  # in the file now
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._fd: Optional[int] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            os.close(self._lock_fd)
            raise

    @classmethod
    def open(cls, path: str) -> Optional["DescriptionLog"]:
        """The log at `path`, or None (with a warning) when it cannot be opened."""
        try:
            return cls(path)
        except BlockingIOError:
            log.warning("events.path %s is in use by another process: this cache's KV-event "
                        "descriptions are kept in memory only", path)
        except OSError as e:
            log.warning("events.path %s cannot be opened (%s): KV-event descriptions are kept "
                        "in memory only", path, e)
        return None

    @property
    def active(self) -> bool:
        return self._fd is not None

    def load(self) -> list[Block]:
        """Every whole, valid record, in the order written; the file is cut
        after the last of them."""
        with self._lock:
            if self._fd is None:
                return []
            try:
                with open(self.path, "rb") as f:
                    data = f.read()
            except OSError as e:
                self._fail(e)
                return []
            out, at = [], 0
            while at + _HEAD.size <= len(data):
                length, crc = _HEAD.unpack_from(data, at)
                payload = data[at + _HEAD.size:at + _HEAD.size + length]
                if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
                    break
                try:
                    out.append(_decode(payload))
                except Exception:  # a record that does not pass check_blocks: the file ends here
                    break
                at += _HEAD.size + length
            if at < len(data):
                log.warning("events.path %s: %d bytes after record %d are not whole records; cut off",
                            self.path, len(data) - at, len(out))
                try:
                    os.ftruncate(self._fd, at)
                except OSError as e:
                    self._fail(e)
            self.records = len(out)
            return out

    def append(self, blocks: list[Block]) -> None:
        if not blocks:
            return
        data = _encode(blocks)
        with self._lock:
            if self._fd is None:
                return
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
                self.records += len(blocks)
            except OSError as e:
                self._fail(e)

    def rewrite(self, snapshot: Callable[[], list[Block]]) -> None:
        """Replaces the file by the blocks `snapshot()` returns (called with
        this log's lock held, so no append lands between the snapshot and
        the new file)."""
        with self._lock:
            if self._fd is None:
                return
            tmp = self.path + ".new"
            try:
                blocks = snapshot()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(_encode(blocks))
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
                new = os.open(self.path, os.O_RDWR | os.O_APPEND)
                os.close(self._fd)
                self._fd = new
                self.records = len(blocks)
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError) -> None:
        log.warning("events.path %s: %s; KV-event descriptions are kept in memory only from now on", self.path, e)
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            os.close(self._lock_fd)

    def close(self) -> None:
        with self._lock:
            self._close()
