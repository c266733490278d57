"""The nvme adapter's read path: `get`, `get_padded` (PaddedReads) and
`get_range` (RangeReads).

A mixin of NvmeAdapter (ucm/adapters/nvme/adapter.py), whose index, write
buffers, lock and I/O engine it uses; the locking rules are the adapter's
(no I/O and no bulk copy under `_lock`).

All walk the index once under the lock (`_walk`): a block still in a write
buffer is copied from memory (the buffer counted as read so it is not
recycled meanwhile); a block in a sealed region is read from the medium
with O_DIRECT, all reads of the batch in flight at once, and verified. A
whole block is verified whole (`_read_disk`), read in place when its
destination is page-aligned whole pages (a block of whole pages, or a
padded read's: each block's extent on the medium is whole pages), else
through warm scratch and a copy; a range reads and verifies only the
chunks that cover it (`_read_disk_ranges`: a version-2 block, one
checksum, is read whole). A block that does not verify is CORRUPT, dropped
and never returned; one that reclamation moved meanwhile is read again
where it is now.
"""
from __future__ import annotations

import ctypes
import mmap
from typing import TYPE_CHECKING, Optional, Sequence

from ucm import _native
from ucm.adapters.base import Key, Status, check_range_args
from ucm.adapters.nvme import format as fmt
from ucm.adapters.nvme.format import ALIGN, align_up as _align_up
from ucm.adapters.nvme.regions import Loc
from ucm.buffers import byte_view
from ucm.errors import ArgumentError

if TYPE_CHECKING:
    from ucm.adapters.nvme.writer import WriteBuffer


class NvmeReads:
    """get / get_padded / get_range of NvmeAdapter; see the module docstring."""

    def get(self, keys: Sequence[Key], dsts: Sequence[object]) -> list[Status]:
        return self._get_whole(keys, dsts, False)

    def get_padded(self, keys: Sequence[Key], dsts: Sequence[object]) -> list[Status]:
        """PaddedReads: a destination may run on to the blob's size rounded up
        to whole pages (`read_unit`, the alignment O_DIRECT needs and every
        block's extent has on the medium); one that is exactly that long and
        page-aligned is read into in place, without scratch or a copy."""
        return self._get_whole(keys, dsts, True)

    def _get_whole(self, keys: Sequence[Key], dsts: Sequence[object], padded: bool) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        out, disk = self._walk(keys, views, None, padded)
        if disk:
            self._read_disk(keys, views, disk, out, padded)
        return [s if s is not None else Status.FAILED for s in out]

    def get_range(self, keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[object]) -> list[Status]:
        """Copies bytes [offsets[i], offsets[i] + len(dsts[i])) of each block
        into dsts[i]. A block in a write buffer is copied from memory; one in
        a sealed region is read only as far as the chunks that cover the
        range (a whole version-2 block), all ranges of the batch in flight at
        once, and those chunks are verified before the range is copied out.
        A chunk that does not verify is CORRUPT for that read and drops the
        block, as in `get`. An empty range inside the blob (offset at most
        its length) is OK and reads nothing."""
        check_range_args(keys, offsets, dsts)
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        out, disk = self._walk(keys, views, offsets)
        if disk:
            self._read_disk_ranges(keys, offsets, views, disk, out)
        return [s if s is not None else Status.FAILED for s in out]

    def _walk(self, keys: Sequence[Key], views: list[memoryview], offsets: Optional[Sequence[int]],
              padded: bool = False) -> tuple[list[Optional[Status]], list[tuple[int, Loc]]]:
        """Statuses of the blocks answered from the index or from a write
        buffer (copied here, no lock held), and the (index, location) of
        those to read from the medium. `offsets` None: whole blocks, whose
        length must be the view's (`padded`: from the block's length to it
        rounded up to whole pages); else ranges inside the blocks."""
        out: list[Optional[Status]] = [None] * len(keys)
        disk: list[tuple[int, Loc]] = []
        mem_reads: list[tuple[int, Loc, "WriteBuffer"]] = []
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                loc = self._index.get(key)
                if loc is None:
                    out[i] = Status.NOT_FOUND
                elif (offsets[i] + len(views[i]) > loc.length if offsets is not None
                      else not loc.length <= len(views[i]) <= _align_up(loc.length) if padded
                      else loc.length != len(views[i])):
                    out[i] = Status.CORRUPT
                elif not views[i]:  # an empty range inside the blob
                    out[i] = Status.OK
                elif loc.region in self._mem:
                    buf = self._mem[loc.region]
                    buf.readers += 1
                    mem_reads.append((i, loc, buf))
                else:
                    disk.append((i, loc))
        for i, loc, buf in mem_reads:
            try:
                at = loc.offset + (offsets[i] if offsets is not None else 0)
                n = len(views[i]) if offsets is not None else loc.length
                with views[i][:n] as dst:
                    _native.copy(dst, buf.view[at:at + n])
                out[i] = Status.OK
            finally:
                with self._lock:
                    buf.readers -= 1
                    self._cond.notify_all()
        return out, disk

    def _bad(self, key: Key, loc: Loc) -> Optional[Status]:
        """A read of `key` at `loc` did not verify: CORRUPT (and the block
        dropped) when it is still there, so the medium holds bad bytes; None
        when reclamation moved it meanwhile (read it where it is now)."""
        with self._lock:
            if self._index.get(key) is loc:
                self._drop_locked(key)
                self._stats["corrupt"] += 1
                return Status.CORRUPT
        return None

    def _read_failed(self) -> Status:
        with self._lock:
            self._stats["read_errors"] += 1
        return Status.FAILED

    def _read_disk(self, keys: Sequence[Key], views: list[memoryview], disk: list[tuple[int, Loc]],
                   out: list[Optional[Status]], padded: bool) -> None:
        """Reads whole blocks into their views: in place where O_DIRECT
        allows it (a page-aligned view of whole pages: a block of whole
        pages, or a padded read's), else through warm scratch and a copy."""
        rs = self.config.region_size
        via = [self.direct_io and (len(views[i]) != _align_up(loc.length) or not _aligned(views[i]))
               for i, loc in disk]
        total = sum(_align_up(loc.length) for (_, loc), v in zip(disk, via) if v)
        if not total:
            self._read_into(keys, views, disk, via, [views[i] for i, _ in disk], out, rs, padded)
            return
        with self._scratch.lease(total) as scratch, memoryview(scratch) as whole:
            targets, at = [], 0
            for (i, loc), v in zip(disk, via):
                if v:  # O_DIRECT needs whole pages at a page-aligned address: through warm scratch
                    targets.append(whole[at:at + _align_up(loc.length)])
                    at += _align_up(loc.length)
                else:
                    targets.append(views[i])
            try:
                self._read_into(keys, views, disk, via, targets, out, rs, padded)
            finally:
                for t, v in zip(targets, via):
                    if v:
                        t.release()

    def _read_into(self, keys: Sequence[Key], views: list[memoryview], disk: list[tuple[int, Loc]], via: list[bool],
                   targets: list[memoryview], out: list[Optional[Status]], rs: int, padded: bool) -> None:
        results = self._io.read_batch(self._fd, targets, [loc.region * rs + loc.offset for _, loc in disk])
        bytes_read = 0
        for (i, loc), target, res, v in zip(disk, targets, results, via):
            if res < loc.length:
                out[i] = self._read_failed()
                continue
            with target[:loc.length] as data:
                good = fmt.verify_block(data, loc.checksum, loc.chunk_bytes, loc.chunks)
                if good and v:
                    with views[i][:loc.length] as dst:
                        _native.copy(dst, data)
            if good:
                out[i] = Status.OK
                bytes_read += loc.length
            else:
                out[i] = self._bad(keys[i], loc)
                if out[i] is None:  # moved by reclamation: read it where it is now
                    out[i] = self._get_whole([keys[i]], [views[i]], padded)[0]
        with self._lock:
            self._stats["bytes_read"] += bytes_read

    def _read_disk_ranges(self, keys: Sequence[Key], offsets: Sequence[int], views: list[memoryview],
                          disk: list[tuple[int, Loc]], out: list[Optional[Status]]) -> None:
        """Reads the covering chunks of each range, verifies them and copies
        the ranges out. A range that is exactly its chunks (a layer of a
        layer-major block whose layers are whole chunks) is read straight
        into its destination when O_DIRECT allows it (page-aligned, whole
        pages) and verified there: no scratch, no second copy; on CORRUPT
        its bytes are then unspecified, as `get`'s. The others go through
        one aligned scratch mapping (a span starts on a chunk, so on a page)."""
        spans = [fmt.chunk_span(offsets[i], len(views[i]), loc.length, loc.chunk_bytes) for i, loc in disk]
        direct = [offsets[i] == start and len(views[i]) == end - start
                  and (not self.direct_io or ((end - start) % fmt.ALIGN == 0 and _aligned(views[i])))
                  for (i, _), (start, end) in zip(disk, spans)]
        total = sum(_align_up(end - start) for (start, end), d in zip(spans, direct) if not d)
        with self._scratch.lease(total) as scratch:
            self._read_ranges_via(keys, offsets, views, disk, out, spans, direct, scratch)

    def _read_ranges_via(self, keys: Sequence[Key], offsets: Sequence[int], views: list[memoryview],
                         disk: list[tuple[int, Loc]], out: list[Optional[Status]], spans: list[tuple[int, int]],
                         direct: list[bool], scratch: mmap.mmap) -> None:
        rs = self.config.region_size
        whole = memoryview(scratch)
        targets, at = [], 0
        for (i, _), (start, end), d in zip(disk, spans, direct):
            if d:
                targets.append(views[i][:end - start])
                continue
            targets.append(whole[at:at + _align_up(end - start)])
            at += _align_up(end - start)
        try:
            results = self._io.read_batch(self._fd, targets, [loc.region * rs + loc.offset + start
                                                              for (_, loc), (start, _) in zip(disk, spans)])
            bytes_read = reads = 0
            for (i, loc), (start, end), target, res, d in zip(disk, spans, targets, results, direct):
                if res < end - start:
                    out[i] = self._read_failed()
                    continue
                with target[:end - start] as data:
                    good = fmt.verify_span(data, start, loc.checksum, loc.chunk_bytes, loc.chunks)
                    if good and not d:  # read through the scratch: copy it out
                        rel = offsets[i] - start
                        _native.copy(views[i], data[rel:rel + len(views[i])])
                if good:
                    out[i] = Status.OK
                    bytes_read += end - start
                    reads += 1
                else:
                    out[i] = self._bad(keys[i], loc)
                    if out[i] is None:  # moved by reclamation: read it where it is now
                        out[i] = self.get_range([keys[i]], [offsets[i]], [views[i]])[0]
            with self._lock:
                self._stats["bytes_read"] += bytes_read
                self._stats["range_reads"] += reads
        finally:
            for t in targets:
                t.release()
            whole.release()


def _aligned(view: memoryview) -> bool:
    if view.readonly:
        return False
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return addr % ALIGN == 0
