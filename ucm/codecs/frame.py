"""The frame of a block stored by a codec tier: header, meta, body.

    offset  size  field
    0       8     magic b"UCMKVF\\x00\\x01" (format version 1)
    8       1     codec id (ucm.codecs: 0 none, 1 lossless, 2 int8, 6 int4;
                  3-5 were earlier int4 formats, retired: a miss)
    9       3     zero
    12      4     meta bytes (u32 LE)
    16      8     raw bytes: the block's size once decoded (u64 LE)
    24      8     body bytes (u64 LE)
    32      8     XXH3-64 of everything after the header (meta and body)
    40      8     XXH3-64 of bytes 0-39
    48      ...   meta, then body

Both checksums cover the stored (encoded) bytes, so a flipped bit anywhere
is found before a decoder sees it; a frame that does not verify, names a
codec this process does not have, or does not decode is a miss.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

from ucm import _native

MAGIC = b"UCMKVF\x00\x01"
HEADER = struct.Struct("<8sB3xIQQQQ")
HEADER_BYTES = HEADER.size  # 48


@dataclass(frozen=True, slots=True)
class FrameHeader:
    codec_id: int
    meta_bytes: int
    raw_bytes: int
    body_bytes: int
    body_checksum: int

    @property
    def stored_bytes(self) -> int:
        return HEADER_BYTES + self.meta_bytes + self.body_bytes


def frame_bytes(meta_bytes: int, body_bytes: int) -> int:
    """Stored size of a frame: the encoded-size formula's last term."""
    return HEADER_BYTES + meta_bytes + body_bytes


def pack(codec_id: int, raw_bytes: int, meta: bytes, body) -> bytearray:
    """The stored frame of one encoded block."""
    body = memoryview(body).cast("B")
    out = bytearray(frame_bytes(len(meta), len(body)))
    out[HEADER_BYTES:HEADER_BYTES + len(meta)] = meta
    out[HEADER_BYTES + len(meta):] = body
    mv = memoryview(out)
    c = _native.checksum(mv[HEADER_BYTES:])
    HEADER.pack_into(out, 0, MAGIC, codec_id, len(meta), raw_bytes, len(body), c, 0)
    struct.pack_into("<Q", out, 40, _native.checksum(mv[:40]))
    return out


def parse_header(head) -> Optional[FrameHeader]:
    """The header of a frame from its first 48 bytes, or None when they are
    not a version-1 header or fail their checksum."""
    head = memoryview(head).cast("B")
    if len(head) < HEADER_BYTES:
        return None
    magic, cid, meta_n, raw_n, body_n, body_c, head_c = HEADER.unpack_from(head, 0)
    if magic != MAGIC or head_c != _native.checksum(head[:40]):
        return None
    return FrameHeader(cid, meta_n, raw_n, body_n, body_c)


def verify(frame) -> Optional[FrameHeader]:
    """The header of a whole stored frame if every byte checks out (header,
    length, checksum over meta and body), else None."""
    frame = memoryview(frame).cast("B")
    h = parse_header(frame)
    if h is None or h.stored_bytes != len(frame):
        return None
    if _native.checksum(frame[HEADER_BYTES:]) != h.body_checksum:
        return None
    return h
