"""On-disk format of the `nvme` region log: encode and decode region footers.

A medium is an array of equal regions (`region_size` bytes each). A region
holds block data from its start, each block at a 4 KiB-aligned offset, and a
footer in its last `footer_bytes(n, m)` bytes (a multiple of 4 KiB):

    entry[0] .. entry[n-1]   ENTRY, 72 bytes each, from the footer's start
    chunk table              CHUNK_SUM (8 bytes) per chunk of each block,
                             entry by entry (m checksums in all)
    zero padding
    trailer                  TRAILER, the region's last 64 bytes

entry:   key (16 bytes), parent key (16 bytes, zero for a root), offset,
         length, block checksum, flags (bit 0: the parent field is set; no
         other bit is defined), chunk size c (a multiple of 4 KiB)
chunks:  the block is cut into ceil(length / c) chunks of c bytes (the last
         one shorter); its table holds the XXH3-64 of each, in order, and
         the entry's block checksum is the XXH3-64 of that table (its 8 *
         ceil(length / c) bytes). So one pass over a block checks all of it
         (`verify_block`), and a byte range is checked by reading only the
         chunks that cover it (`chunk_span`, `verify_span`).
trailer: magic "UCMREGN3", region sequence number, entry count n, footer
         size in bytes, XXH3-64 of the n entries, region index, region size,
         XXH3-64 of the trailer's first 56 bytes

Every integer is unsigned 64-bit little-endian. The chain of checksums is
trailer -> entries -> each block's chunk table -> each chunk.

Versions. 3 is written. 2 ("UCMREGN2", the same trailer) is still read:
64-byte entries without the chunk size, no chunk table, and the block
checksum is the XXH3-64 of the block's bytes; its entries decode with
`chunk_bytes` 0, so that a range of such a block is read and verified whole.
1 ("UCMREGN1") had 48-byte entries without a parent and a 56-byte trailer
without the region size. A region carrying any other version is
`Refused.OTHER_FORMAT`: the reader treats it as empty and never parses it.

Nothing here raises for bad bytes: decoding returns a value or a `Refused`
reason, so that garbage on a medium is an empty region, never an exception
at start-up. Only misuse (a buffer of the wrong size, a bad key type, an
entry whose chunk table does not match its length) raises `ArgumentError`.
Pure functions, callable from any thread.
"""
from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple, Optional, Sequence, Union

from ucm import _native
from ucm.errors import ArgumentError

VERSION = 3
ALIGN = 4096
KEY_BYTES = 16
CHUNK_SUM = 8  # bytes of one chunk's checksum in a chunk table
MAGIC = int.from_bytes(b"UCMREGN3", "little")
MAGIC_V2 = int.from_bytes(b"UCMREGN2", "little")
_MAGIC_FAMILY = int.from_bytes(b"UCMREGN\0", "little")  # any version: the top byte is the digit
_MAGIC_MASK = (1 << 56) - 1
ENTRY = struct.Struct("<16s16sQQQQQ")  # key, parent, offset, length, checksum, flags, chunk size
ENTRY_V2 = struct.Struct("<16s16sQQQQ")  # key, parent, offset, length, checksum, flags
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
    # an entry outside the data area, overlapping another, with unknown flags, a bad chunk size, or a
    # chunk table that does not match its checksum or does not end where the footer says
    BAD_ENTRY = "bad_entry"


class FooterEntry(NamedTuple):
    """One block of a region, as its footer describes it. `chunk_bytes` 0
    (and `chunks` empty): a version-2 entry, whose `checksum` is the XXH3-64
    of the block's bytes; otherwise `chunks` is the block's chunk table and
    `checksum` the XXH3-64 of it (see `block_checksums`)."""

    key: Key
    parent: Optional[Key]
    offset: int
    length: int
    checksum: int
    chunk_bytes: int = 0
    chunks: bytes = b""


class Trailer(NamedTuple):
    seq: int
    n_entries: int
    footer_bytes: int
    entries_checksum: int
    region: int
    region_size: int
    version: int = VERSION


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def n_chunks(length: int, chunk_bytes: int) -> int:
    """How many chunks of `chunk_bytes` a block of `length` bytes has."""
    return -(-length // chunk_bytes)


def block_footprint(length: int, chunk_table_bytes: int) -> int:
    """What one block takes of its region: its pages, its footer entry and
    its chunk table. The adapter counts this in `used_bytes`, so that the
    owner's accounting (`footprint_bytes`) is the medium's; the trailer, one
    per region, belongs to no block."""
    return align_up(length) + ENTRY.size + chunk_table_bytes


def footer_bytes(n_entries: int, total_chunks: int = 0) -> int:
    """Size of the footer of a region holding `n_entries` blocks that have
    `total_chunks` chunks together."""
    return align_up(n_entries * ENTRY.size + total_chunks * CHUNK_SUM + TRAILER_BYTES)


def _footer_bytes_v2(n_entries: int) -> int:
    return align_up(n_entries * ENTRY_V2.size + TRAILER_BYTES)


def check_chunk_bytes(chunk_bytes: int) -> int:
    """`chunk_bytes` if it is a valid chunk size (a positive multiple of 4 KiB), else ArgumentError."""
    if not isinstance(chunk_bytes, int) or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
        raise ArgumentError(f"nvme chunk size must be a positive multiple of {ALIGN} bytes, got {chunk_bytes!r}")
    return chunk_bytes


def block_checksums(data: Any, chunk_bytes: int) -> tuple[int, bytes]:
    """(block checksum, chunk table) of a block's bytes, as a version-3
    entry records them."""
    chunks = _native.chunk_checksums(data, chunk_bytes)
    return _native.checksum(chunks), chunks


def verify_block(data: Any, checksum: int, chunk_bytes: int, chunks: bytes) -> bool:
    """Whether a whole block's bytes match its entry: every chunk (version
    3), or the block checksum (version 2, `chunk_bytes` 0)."""
    if chunk_bytes == 0:
        return _native.checksum(data) == checksum
    return _native.chunk_checksums(data, chunk_bytes) == chunks


def chunk_span(offset: int, n: int, length: int, chunk_bytes: int) -> tuple[int, int]:
    """[start, end) in the block of the chunks that cover bytes [offset,
    offset + n) (n > 0, inside the block): what a range read reads and
    verifies. `chunk_bytes` 0 (version 2): the whole block."""
    if chunk_bytes == 0:
        return 0, length
    first = offset // chunk_bytes
    last = (offset + n - 1) // chunk_bytes
    return first * chunk_bytes, min(length, (last + 1) * chunk_bytes)


def verify_span(data: Any, start: int, checksum: int, chunk_bytes: int, chunks: bytes) -> bool:
    """Whether `data`, the block's bytes from `start` (as `chunk_span`
    gives them), matches its entry's chunks (version 2: the whole block)."""
    if chunk_bytes == 0:
        return start == 0 and _native.checksum(data) == checksum
    first = start // chunk_bytes
    got = _native.chunk_checksums(data, chunk_bytes)
    return start % chunk_bytes == 0 and got == chunks[first * CHUNK_SUM:first * CHUNK_SUM + len(got)]


def encode_footer_into(dst: memoryview, entries: Sequence[FooterEntry], seq: int, region: int,
                       region_size: int) -> None:
    """Writes the version-3 footer of `entries` into `dst`, which must be
    exactly `footer_bytes(len(entries), total chunks)` bytes (the region's
    last bytes). Every entry needs its chunk size and table (`block_checksums`)."""
    n = len(entries)
    total = 0
    for i, e in enumerate(entries):
        if not e.chunk_bytes or len(e.chunks) != n_chunks(e.length, e.chunk_bytes) * CHUNK_SUM:
            raise ArgumentError(f"nvme footer: entry {i} of {e.length} bytes needs a chunk size and "
                                f"{CHUNK_SUM} bytes per chunk, got chunk size {e.chunk_bytes} and "
                                f"{len(e.chunks)} bytes")
        total += len(e.chunks) // CHUNK_SUM
    size = footer_bytes(n, total)
    if len(dst) != size:
        raise ArgumentError(f"nvme footer of {n} entries needs {size} bytes, got a buffer of {len(dst)}")
    dst[:] = bytes(size)
    at = n * ENTRY.size
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
        ENTRY.pack_into(dst, i * ENTRY.size, e.key, parent, e.offset, e.length, e.checksum, flags, e.chunk_bytes)
        dst[at:at + len(e.chunks)] = e.chunks
        at += len(e.chunks)
    ecsum = _native.checksum(dst[:n * ENTRY.size])
    head = TRAILER.pack(MAGIC, seq, n, size, ecsum, region, region_size, 0)[:-8]
    TRAILER.pack_into(dst, size - TRAILER_BYTES, MAGIC, seq, n, size, ecsum, region, region_size,
                      _native.checksum(head))


def encode_footer(entries: Sequence[FooterEntry], seq: int, region: int, region_size: int) -> bytes:
    """The footer of `entries` as bytes (see `encode_footer_into`)."""
    total = sum(len(e.chunks) // CHUNK_SUM for e in entries)
    out = bytearray(footer_bytes(len(entries), total))
    encode_footer_into(memoryview(out), entries, seq, region, region_size)
    return bytes(out)


def decode_trailer(tail: memoryview, region: int, region_size: int) -> Union[Trailer, Refused]:
    """The trailer in the last TRAILER_BYTES of `tail` (bytes that end where
    region `region` ends), or why it is refused. A version-3 trailer's
    footer size is checked against its entries in `decode_entries`."""
    if len(tail) < TRAILER_BYTES:
        raise ArgumentError(f"nvme trailer needs {TRAILER_BYTES} bytes, got {len(tail)}")
    at = len(tail) - TRAILER_BYTES
    magic, seq, n, fbytes, ecsum, reg, rsize, tcsum = TRAILER.unpack_from(tail, at)
    if magic not in (MAGIC, MAGIC_V2):
        if magic & _MAGIC_MASK == _MAGIC_FAMILY:
            return Refused.OTHER_FORMAT
        return Refused.EMPTY if magic == 0 else Refused.BAD_TRAILER
    if tcsum != _native.checksum(tail[at:at + TRAILER_BYTES - 8]):
        return Refused.BAD_TRAILER
    if reg != region or rsize != region_size or fbytes > region_size:
        return Refused.BAD_TRAILER
    if magic == MAGIC_V2:
        if fbytes != _footer_bytes_v2(n):
            return Refused.BAD_TRAILER
        return Trailer(seq, n, fbytes, ecsum, reg, rsize, 2)
    if fbytes % ALIGN or fbytes < footer_bytes(n):
        return Refused.BAD_TRAILER
    return Trailer(seq, n, fbytes, ecsum, reg, rsize, VERSION)


def decode_entries(foot: memoryview, trailer: Trailer) -> Union[tuple[FooterEntry, ...], Refused]:
    """The entries of a region's footer, or why they are refused. `foot`
    ends where the region ends and holds at least `trailer.footer_bytes`
    bytes (the last page read for the trailer is enough for a footer of one
    page). Every entry lies in the data area (4 KiB-aligned, before the
    footer), no two overlap, and (version 3) each chunk table matches its
    entry's checksum, with entries and tables filling the footer exactly as
    `footer_bytes` sizes it; later duplicates of a key follow earlier ones
    in the result."""
    fbytes, n = trailer.footer_bytes, trailer.n_entries
    if len(foot) < fbytes:
        raise ArgumentError(f"nvme footer needs {fbytes} bytes, got {len(foot)}")
    start = len(foot) - fbytes
    v3 = trailer.version == VERSION
    entry = ENTRY if v3 else ENTRY_V2
    if _native.checksum(foot[start:start + n * entry.size]) != trailer.entries_checksum:
        return Refused.BAD_ENTRIES
    limit = trailer.region_size - fbytes
    table_end = len(foot) - TRAILER_BYTES
    at = start + n * entry.size
    out: list[FooterEntry] = []
    for fields in entry.iter_unpack(foot[start:start + n * entry.size]):
        key, parent, off, length, csum, flags = fields[:6]
        if flags & ~FLAG_PARENT or (not flags & FLAG_PARENT and parent != _NO_PARENT):
            return Refused.BAD_ENTRY
        if length == 0 or off % ALIGN or off + length > limit:
            return Refused.BAD_ENTRY
        chunk_bytes, chunks = 0, b""
        if v3:
            chunk_bytes = fields[6]
            if chunk_bytes < ALIGN or chunk_bytes % ALIGN or chunk_bytes > trailer.region_size:
                return Refused.BAD_ENTRY
            size = n_chunks(length, chunk_bytes) * CHUNK_SUM
            if at + size > table_end:
                return Refused.BAD_ENTRY
            chunks = bytes(foot[at:at + size])
            at += size
            if _native.checksum(chunks) != csum:
                return Refused.BAD_ENTRY
        out.append(FooterEntry(key, parent if flags & FLAG_PARENT else None, off, length, csum, chunk_bytes,
                               chunks))
    if v3 and align_up(at - start + TRAILER_BYTES) != fbytes:
        return Refused.BAD_ENTRY
    extents = sorted((e.offset, e.offset + align_up(e.length)) for e in out)
    for (_, end), (nxt, _) in zip(extents, extents[1:]):
        if nxt < end:
            return Refused.BAD_ENTRY
    return tuple(out)
