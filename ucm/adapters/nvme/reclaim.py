"""Reading a victim region's live blocks back into the write buffer that
will rewrite it (nvme region reclamation).

The adapter picks the victim (`regions.choose_victim`) and marks it
reclaiming under its lock, then calls `read_back` with no lock held: it
reads the region's used span in `io_chunk` pieces, verifies each live
block's checksum and copies those that fit to the head of the buffer,
leaving room for the blob that triggered the reclaim. The adapter then
reconciles the result under its lock (a block deleted or dropped meanwhile
stays out). Nothing here touches the adapter's state: only the device, a
scratch mapping and the buffer, which is nobody else's meanwhile.
"""
from __future__ import annotations

import mmap
from typing import Any

from ucm import _native
from ucm.adapters.nvme.format import align_up, footer_bytes
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
              io_chunk: int) -> tuple[int, list[tuple[Key, Loc, int]], list[tuple[Key, Loc, str]]]:
    """Copies the live blocks (`live`, by offset) of `buf.region` from the
    medium to the head of `buf`, keeping room for a blob of `reserve` bytes
    and the footer. Returns the bytes used in `buf`, the blocks placed
    (key, location read, offset in buf) and those refused (key, location,
    why: "room", "corrupt" or "read_errors")."""
    end = max(loc.offset + align_up(loc.length) for _, loc in live)
    placed: list[tuple[Key, Loc, int]] = []
    refused: list[tuple[Key, Loc, str]] = []
    at = n_entries = 0
    scratch = mmap.mmap(-1, end)
    try:
        ok_read = read_ranges(io, fd, [(scratch, 0, end)], buf.region, region_size, io_chunk)[0] == end
        for key, loc in live:
            src = memoryview(scratch)[loc.offset:loc.offset + loc.length]
            good = ok_read and _native.checksum(src) == loc.checksum
            room = at + align_up(loc.length) + align_up(reserve) + footer_bytes(n_entries + 2)
            if good and room <= region_size:
                _native.copy(buf.view[at:at + loc.length], src)
                placed.append((key, loc, at))
                at += align_up(loc.length)
                n_entries += 1
            else:
                refused.append((key, loc, "room" if good else "corrupt" if ok_read else "read_errors"))
            src.release()
    finally:
        scratch.close()
    return at, placed, refused
