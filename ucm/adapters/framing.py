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
KEY_BYTES = 16
_HEADER = struct.Struct("<4sHH16sQQ")
HEADER_BYTES = _HEADER.size  # 40


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
