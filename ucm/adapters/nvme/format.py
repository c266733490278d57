"""On-disk format of the `nvme` region log: encode and decode region footers.

A medium is an array of equal regions (`region_size` bytes each). A region
holds block data from its start, each block at a 4 KiB-aligned offset, and a
footer in its last `footer_bytes(n)` bytes (a multiple of 4 KiB):

    entry[0] .. entry[n-1]   ENTRY, 64 bytes each, from the footer's start
    zero padding
    trailer                  TRAILER, the region's last 64 bytes

entry:   key (16 bytes), parent key (16 bytes, zero for a root), offset,
         length, XXH3-64 checksum of the block's bytes, flags (bit 0: the
         parent field is set; no other bit is defined)
trailer: magic "UCMREGN2", region sequence number, entry count n, footer
         size in bytes, XXH3-64 of the n entries, region index, region size,
         XXH3-64 of the trailer's first 56 bytes

Every integer is unsigned 64-bit little-endian.

Versions. 1 ("UCMREGN1") had 48-byte entries without a parent and a
56-byte trailer without the region size. A region carrying any other
version is `Refused.OTHER_FORMAT`: the reader treats it as empty and never
parses it.

Nothing here raises for bad bytes: decoding returns a value or a `Refused`
reason, so that garbage on a medium is an empty region, never an exception
at start-up. Only misuse (a buffer of the wrong size, a bad key type) raises
`ArgumentError`. Pure functions, callable from any thread.
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple, Optional, Sequence, Union

from ucm import _native
from ucm.errors import ArgumentError

VERSION = 2
ALIGN = 4096
KEY_BYTES = 16
MAGIC = int.from_bytes(b"UCMREGN2", "little")
_MAGIC_FAMILY = int.from_bytes(b"UCMREGN\0", "little")  # any version: the top byte is the digit
_MAGIC_MASK = (1 << 56) - 1
ENTRY = struct.Struct("<16s16sQQQQ")  # key, parent, offset, length, checksum, flags
TRAILER = struct.Struct("<QQQQQQQQ")  # magic, seq, n, footer_bytes, entries_csum, region, region_size, csum
TRAILER_BYTES = TRAILER.size
FLAG_PARENT = 1
_NO_PARENT = bytes(KEY_BYTES)

Key = bytes


class Refused(enum.Enum):
    """Why a region's footer is not used (the region counts as empty)."""

    EMPTY = "empty"  # no trailer: never sealed, or invalidated before a rewrite
    OTHER_FORMAT = "other_format"  # a trailer of another format version
    BAD_TRAILER = "bad_trailer"  # checksum, region index, region size or footer size wrong
    BAD_ENTRIES = "bad_entries"  # the entries' checksum does not match
    BAD_ENTRY = "bad_entry"  # an entry outside the data area, overlapping another, or with unknown flags


class FooterEntry(NamedTuple):
    """One block of a region, as its footer describes it."""

    key: Key
    parent: Optional[Key]
    offset: int
    length: int
    checksum: int


class Trailer(NamedTuple):
    seq: int
    n_entries: int
    footer_bytes: int
    entries_checksum: int
    region: int
    region_size: int


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def footer_bytes(n_entries: int) -> int:
    """Size of the footer of a region holding `n_entries` blocks."""
    return align_up(n_entries * ENTRY.size + TRAILER_BYTES)


def encode_footer_into(dst: memoryview, entries: Sequence[FooterEntry], seq: int, region: int,
                       region_size: int) -> None:
    """Writes the footer of `entries` into `dst`, which must be exactly
    `footer_bytes(len(entries))` bytes (the region's last bytes)."""
    n = len(entries)
    size = footer_bytes(n)
    if len(dst) != size:
        raise ArgumentError(f"nvme footer of {n} entries needs {size} bytes, got a buffer of {len(dst)}")
    dst[:] = bytes(size)
    for i, e in enumerate(entries):
        if e.parent is None:
            parent, flags = _NO_PARENT, 0
        elif isinstance(e.parent, bytes) and len(e.parent) == KEY_BYTES:
            parent, flags = e.parent, FLAG_PARENT
        else:
            raise ArgumentError(f"nvme footer: parent of entry {i} must be None or {KEY_BYTES} bytes, "
                                f"got {e.parent!r:.40}")
        if not isinstance(e.key, bytes) or len(e.key) != KEY_BYTES:
            raise ArgumentError(f"nvme footer: key of entry {i} must be {KEY_BYTES} bytes, got {e.key!r:.40}")
        ENTRY.pack_into(dst, i * ENTRY.size, e.key, parent, e.offset, e.length, e.checksum, flags)
    ecsum = _native.checksum(dst[:n * ENTRY.size])
    head = TRAILER.pack(MAGIC, seq, n, size, ecsum, region, region_size, 0)[:-8]
    TRAILER.pack_into(dst, size - TRAILER_BYTES, MAGIC, seq, n, size, ecsum, region, region_size,
                      _native.checksum(head))


def encode_footer(entries: Sequence[FooterEntry], seq: int, region: int, region_size: int) -> bytes:
    """The footer of `entries` as bytes (see `encode_footer_into`)."""
    out = bytearray(footer_bytes(len(entries)))
    encode_footer_into(memoryview(out), entries, seq, region, region_size)
    return bytes(out)


def decode_trailer(tail: memoryview, region: int, region_size: int) -> Union[Trailer, Refused]:
    """The trailer in the last TRAILER_BYTES of `tail` (bytes that end where
    region `region` ends), or why it is refused."""
    if len(tail) < TRAILER_BYTES:
        raise ArgumentError(f"nvme trailer needs {TRAILER_BYTES} bytes, got {len(tail)}")
    at = len(tail) - TRAILER_BYTES
    magic, seq, n, fbytes, ecsum, reg, rsize, tcsum = TRAILER.unpack_from(tail, at)
    if magic != MAGIC:
        if magic & _MAGIC_MASK == _MAGIC_FAMILY:
            return Refused.OTHER_FORMAT
        return Refused.EMPTY if magic == 0 else Refused.BAD_TRAILER
    if tcsum != _native.checksum(tail[at:at + TRAILER_BYTES - 8]):
        return Refused.BAD_TRAILER
    if reg != region or rsize != region_size or fbytes != footer_bytes(n) or fbytes > region_size:
        return Refused.BAD_TRAILER
    return Trailer(seq, n, fbytes, ecsum, reg, rsize)


def decode_entries(foot: memoryview, trailer: Trailer) -> Union[tuple[FooterEntry, ...], Refused]:
    """The entries of a region's footer, or why they are refused. `foot`
    ends where the region ends and holds at least `trailer.footer_bytes`
    bytes (the last page read for the trailer is enough for a footer of one
    page). Every entry lies in the data area (4 KiB-aligned, before the
    footer) and no two overlap; later duplicates of a key follow earlier
    ones in the result."""
    fbytes, n = trailer.footer_bytes, trailer.n_entries
    if len(foot) < fbytes:
        raise ArgumentError(f"nvme footer needs {fbytes} bytes, got {len(foot)}")
    start = len(foot) - fbytes
    if _native.checksum(foot[start:start + n * ENTRY.size]) != trailer.entries_checksum:
        return Refused.BAD_ENTRIES
    limit = trailer.region_size - fbytes
    out: list[FooterEntry] = []
    for key, parent, off, length, csum, flags in ENTRY.iter_unpack(foot[start:start + n * ENTRY.size]):
        if flags & ~FLAG_PARENT or (not flags & FLAG_PARENT and parent != _NO_PARENT):
            return Refused.BAD_ENTRY
        if length == 0 or off % ALIGN or off + length > limit:
            return Refused.BAD_ENTRY
        out.append(FooterEntry(key, parent if flags & FLAG_PARENT else None, off, length, csum))
    extents = sorted((e.offset, e.offset + align_up(e.length)) for e in out)
    for (_, end), (nxt, _) in zip(extents, extents[1:]):
        if nxt < end:
            return Refused.BAD_ENTRY
    return tuple(out)
