"""The value header of the cluster tiers (mooncake, redis, fs).

A shared store holds bytes that other nodes, other deployments, a restarted
server or a bad disk may have written. So every value a cluster adapter
writes is `header || payload`, and every value it reads back is checked
against the header before the caller sees OK:

    offset  size  field
    0       4     magic b"UCMF"
    4       2     format version (1)
    6       2     flags (0; any other value is rejected)
    8       16    the block key the value was written under
    24      8     payload length in bytes
    32      8     XXH3-64 of the payload (`ucm._native.checksum`)

little-endian, 40 bytes. A value whose magic, version, flags, key, length or
checksum does not match is `Status.CORRUPT`: foreign or damaged bytes are a
miss, never data. The header is written and read as its own buffer beside the
payload (scatter/gather), so payloads are not copied to frame them.

Chunked frames (version 2, `fs`) serve range reads: the header is followed by
a chunk table, the XXH3-64 of each CHUNK_BYTES piece of the payload (the last
one shorter), little-endian, and the header's checksum is the XXH3-64 of that
table instead of the payload's:

    0       40    the header above, version 2
    40      8 m   chunk table, m = ceil(length / CHUNK_BYTES)
    40+8m   n     payload

So a whole value is checked in one pass over the payload (`verify_chunked`)
and a range by the header, the table and only the chunks that cover it
(`chunked_span`, `verify_chunked_span`). The chunk size is part of the
version; the header's size follows from the payload length
(`chunked_header_bytes`) and the payload length from the value's size
(`chunked_payload_bytes`). `mooncake` and `redis` write version 1.

Pure functions, no state: safe from any thread.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Optional

from ucm import _native
from ucm.adapters.base import Key, Status
from ucm.errors import ArgumentError

MAGIC = b"UCMF"
VERSION = 1
CHUNKED_VERSION = 2
KEY_BYTES = 16
_HEADER = struct.Struct("<4sHH16sQQ")
HEADER_BYTES = _HEADER.size  # 40
CHUNK_BYTES = 32 << 10  # of a chunked frame (version 2)
CHUNK_SUM = 8


@dataclass(frozen=True, slots=True)
class FrameHeader:
    key: Key
    length: int
    checksum: int


def check_key(key: Any) -> Key:
    """The key as bytes; raises ArgumentError unless it is 16 bytes."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ArgumentError(f"block key must be {KEY_BYTES} bytes, got {type(key).__name__} "
                            f"of length {len(key) if hasattr(key, '__len__') else '?'}")
    return bytes(key)


def pack_header(key: Key, payload: Any, checksum: Optional[int] = None) -> bytes:
    """The header for `payload` stored under `key` (checksum computed unless given)."""
    view = memoryview(payload)
    csum = _native.checksum(view) if checksum is None else checksum
    return _HEADER.pack(MAGIC, VERSION, 0, key, view.nbytes, csum)


def pack_header_into(buf: Any, offset: int, key: Key, length: int, checksum: int) -> None:
    _HEADER.pack_into(buf, offset, MAGIC, VERSION, 0, key, length, checksum)


def parse_header(data: Any) -> Optional[FrameHeader]:
    """The header at the start of `data`, or None if it is not a ucm header."""
    view = memoryview(data)
    if view.nbytes < HEADER_BYTES:
        return None
    magic, version, flags, key, length, csum = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION or flags != 0:
        return None
    return FrameHeader(key, length, csum)


def verify(key: Key, header: Any, payload: Any) -> Status:
    """OK if `header` describes exactly `payload` stored under `key`, else CORRUPT."""
    h = parse_header(header)
    if h is None or h.key != key or h.length != memoryview(payload).nbytes:
        return Status.CORRUPT
    return Status.OK if _native.checksum(payload) == h.checksum else Status.CORRUPT


def verify_frame(key: Key, frame: Any, dst_size: int) -> Status:
    """Checks a whole stored value (`header || payload`) read back in one
    piece against `key` and the size the caller expects."""
    view = memoryview(frame)
    if view.nbytes != HEADER_BYTES + dst_size:
        return Status.CORRUPT
    return verify(key, view[:HEADER_BYTES], view[HEADER_BYTES:])


# ---- chunked frames (version 2) ----------------------------------------------
def chunked_header_bytes(length: int) -> int:
    """Header and chunk table of a chunked frame of `length` payload bytes."""
    return HEADER_BYTES + CHUNK_SUM * -(-length // CHUNK_BYTES)


def chunked_payload_bytes(value_bytes: int) -> Optional[int]:
    """The payload length of a chunked frame of `value_bytes` bytes in all,
    or None when no payload length makes a frame of that size."""
    rest = value_bytes - HEADER_BYTES
    if rest < 0:
        return None
    m = -(-rest // (CHUNK_BYTES + CHUNK_SUM))
    length = rest - CHUNK_SUM * m
    return length if length >= 0 and -(-length // CHUNK_BYTES) == m else None


def pack_chunked_header(key: Key, payload: Any) -> bytes:
    """Header and chunk table of `payload` stored under `key` (version 2)."""
    view = memoryview(payload)
    chunks = _native.chunk_checksums(view, CHUNK_BYTES)
    return _HEADER.pack(MAGIC, CHUNKED_VERSION, 0, key, view.nbytes, _native.checksum(chunks)) + chunks


def _chunked_table(key: Key, header: Any, length: int) -> Optional[memoryview]:
    """The chunk table of a chunked header of `length` payload bytes stored
    under `key`, once the header's fields and the table's checksum match;
    else None."""
    view = memoryview(header)
    if view.nbytes != chunked_header_bytes(length):
        return None
    magic, version, flags, hkey, hlen, csum = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != CHUNKED_VERSION or flags != 0 or hkey != key or hlen != length:
        return None
    table = view[HEADER_BYTES:]
    return table if _native.checksum(table) == csum else None


def verify_chunked(key: Key, header: Any, payload: Any) -> Status:
    """OK if the chunked `header` (with its table) describes exactly
    `payload` stored under `key`: every chunk checked. Else CORRUPT."""
    n = memoryview(payload).nbytes
    table = _chunked_table(key, header, n)
    if table is None:
        return Status.CORRUPT
    return Status.OK if _native.chunk_checksums(payload, CHUNK_BYTES) == table else Status.CORRUPT


def chunked_span(offset: int, n: int, length: int) -> tuple[int, int]:
    """[start, end) in the payload of the chunks that cover [offset, offset
    + n) (n > 0, inside a payload of `length` bytes)."""
    return offset // CHUNK_BYTES * CHUNK_BYTES, min(length, -(-(offset + n) // CHUNK_BYTES) * CHUNK_BYTES)


def verify_chunked_span(key: Key, header: Any, length: int, start: int, span: Any) -> Status:
    """OK if `span`, the payload's bytes from `start` (as `chunked_span`
    gives them), matches the chunked `header` of a `length`-byte payload
    stored under `key`. Else CORRUPT."""
    table = _chunked_table(key, header, length)
    if table is None or start % CHUNK_BYTES:
        return Status.CORRUPT
    got = _native.chunk_checksums(span, CHUNK_BYTES)
    first = start // CHUNK_BYTES * CHUNK_SUM
    return Status.OK if table[first:first + len(got)] == got else Status.CORRUPT
