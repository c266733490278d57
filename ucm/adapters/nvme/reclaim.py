"""Reading a victim region's live blocks back into the write buffer that
will rewrite it (nvme region reclamation).

The adapter picks the victim (`regions.choose_victim`) and marks it
reclaiming under its lock, then calls `read_back` with no lock held: it
reads the region's used span in `io_chunk` pieces, verifies each live
block (every chunk) and copies those that fit to the head of the buffer,
leaving room for the blob that triggered the reclaim. A block re-inserted
keeps its chunk table; one recovered from a version-2 region (a block
checksum only) gets a table computed from its verified bytes, so that the
rewritten region is all version 3. The adapter then
reconciles the result under its lock (a block deleted or dropped meanwhile
stays out). Nothing here touches the adapter's state: only the device, a
scratch mapping and the buffer, which is nobody else's meanwhile.
"""
from __future__ import annotations

import mmap
from typing import Any

from ucm import _native
from ucm.adapters.nvme.format import CHUNK_SUM, align_up, block_checksums, footer_bytes, n_chunks, verify_block
from ucm.adapters.nvme.regions import Loc
from ucm.adapters.nvme.writer import WriteBuffer

Key = bytes


def read_ranges(io: Any, fd: int, ranges: list[tuple[Any, int, int]], region: int, region_size: int,
                io_chunk: int) -> list[int]:
    """Reads (buffer, offset-in-region, length) ranges of one region; per
    range the bytes read, or -errno."""
    views, offsets, owners = [], [], []
    for i, (b, off, length) in enumerate(ranges):
        mv = memoryview(b)
        for c in range(0, length, io_chunk):
            views.append(mv[c:min(length, c + io_chunk)])
            offsets.append(region * region_size + off + c)
            owners.append(i)
    results = io.read_batch(fd, views, offsets)
    total = [0] * len(ranges)
    for i, r in zip(owners, results):
        if total[i] < 0:
            continue
        total[i] = r if r < 0 else total[i] + r
    for v in views:
        v.release()
    return total


def read_back(io: Any, fd: int, buf: WriteBuffer, live: list[tuple[Key, Loc]], reserve: int, region_size: int,
              io_chunk: int, chunk_bytes: int) -> tuple[int, int, list[tuple[Key, Loc, Loc]],
                                                        list[tuple[Key, Loc, str]]]:
    """Copies the live blocks (`live`, by offset) of `buf.region` from the
    medium to the head of `buf`, keeping room for a blob of `reserve` bytes
    (in chunks of `chunk_bytes`) and the footer. Returns the bytes used in
    `buf`, the chunks of the blocks placed, the blocks placed (key, location
    read, location in `buf` with its chunk table) and those refused (key,
    location, why: "room", "corrupt" or "read_errors")."""
    end = max(loc.offset + align_up(loc.length) for _, loc in live)
    placed: list[tuple[Key, Loc, Loc]] = []
    refused: list[tuple[Key, Loc, str]] = []
    at = n_entries = total_chunks = 0
    reserve_chunks = n_chunks(reserve, chunk_bytes)
    scratch = mmap.mmap(-1, end)
    try:
        ok_read = read_ranges(io, fd, [(scratch, 0, end)], buf.region, region_size, io_chunk)[0] == end
        for key, loc in live:
            src = memoryview(scratch)[loc.offset:loc.offset + loc.length]
            good = ok_read and verify_block(src, loc.checksum, loc.chunk_bytes, loc.chunks)
            if good and not loc.chunk_bytes:  # a version-2 block: its chunk table, from verified bytes
                (csum, chunks), cb = block_checksums(src, chunk_bytes), chunk_bytes
            else:
                csum, cb, chunks = loc.checksum, loc.chunk_bytes, loc.chunks
            m = len(chunks) // CHUNK_SUM
            room = (at + align_up(loc.length) + align_up(reserve)
                    + footer_bytes(n_entries + 2, total_chunks + m + reserve_chunks))
            if good and room <= region_size:
                _native.copy(buf.view[at:at + loc.length], src)
                placed.append((key, loc, Loc(buf.region, at, loc.length, csum, loc.parent, cb, chunks)))
                at += align_up(loc.length)
                n_entries += 1
                total_chunks += m
            else:
                refused.append((key, loc, "room" if good else "corrupt" if ok_read else "read_errors"))
            src.release()
    finally:
        scratch.close()
    return at, total_chunks, placed, refused
