"""`nvme`: a log-structured region store on a directory or a block device.

Layout. The medium is an array of equal regions (`region_size` bytes): a
file `ucm-regions.dat` in the configured directory, or the block device
itself. A region holds blocks appended at 4 KiB-aligned offsets from its
start, and a footer at its end: one entry per block (key, parent key,
offset, length, checksum, chunk size), each block's chunk table (the
XXH3-64 of every `chunk_bytes` piece of it), then a trailer in the last
bytes (magic and format version, region sequence number, entry count,
footer size, checksum of the entries, region index and size, checksum of
the trailer). The format (version 3; version-2 regions, without chunk
tables, are still read) and its decoding are in `ucm.adapters.nvme.format`.
There is no file per block and no directory scan.

Writes. `put` appends blocks into an in-memory region buffer (readable at
once). A full buffer is sealed on a background thread: the region's old
trailer is invalidated, the data is written with O_DIRECT in `io_chunk`
pieces all in flight on the native I/O threads, then the footer. A crash at
any instant leaves each region either with a valid footer describing intact
data, or with none (ignored at restart); block checksums catch the rest.

Reads. The index maps key -> (region, offset, length, checksum, parent,
chunk table). Blocks in a sealed region are read with O_DIRECT (batched,
many in flight) and verified, every chunk; a bad checksum is a CORRUPT
status, the block is dropped, never returned. `get_range` (RangeReads)
reads only the chunks that cover the range (4 KiB-aligned, as O_DIRECT
needs), verifies those and copies the range out: a chunk that does not
verify is CORRUPT for that read and drops the block as `get` does, while a
range that does not touch it, read before, was served verified. A range of
a block from a version-2 region (one checksum for the block) reads and
verifies the whole block. Blocks still in a write buffer are served from
memory by both. The read path is ucm/adapters/nvme/reads.py. The index
keeps each block's chunk table: 8 bytes per chunk, 1/4096 of the data at
32 KiB chunks.

Space. When no region is free, the region with the fewest live bytes (the
oldest on ties) is reclaimed in place: its live blocks are read back and
re-inserted at the head of the new buffer for that same region (with their
parents); those that no longer fit are dropped and reported by
`drain_dropped()`. `capacity_bytes` is the logical capacity the owner
should fill: `usable_fraction` of the medium, the rest being slack for
reclamation.

Restart. The index is rebuilt from the trailers and footers alone (no
payload reads), read in batches into a few large buffers; when a key
appears in several regions the newest wins. A region whose footer is
refused (garbage, torn, another format version) counts as empty.
`iter_entries()` gives each block's parent, so the owner can rebuild its
prefix tree. The restart path is ucm/adapters/nvme/recovery.py.

Failures. A failed region write (ENOSPC, EIO) drops that region's blocks
(reported by `drain_dropped()`), and for `retry_after_s` new puts answer
NO_SPACE at once instead of queueing work that will fail.

Threads. Any method may be called from any thread. `put` copies into the
open buffer on the caller's thread; a full buffer is written by the sealer
thread (`ucm-nvme-sealer`); `get` reads on the caller's thread, through the
native I/O threads. Lock order: `_lock` (with `_cond`, its condition),
then nothing: no I/O and no bulk copy runs under it. A writer that reclaims
a region marks it `reclaiming` under the lock, then reads it back and copies
its live blocks into the new buffer with no lock held; meanwhile readers of
its blocks still read them from the medium (nothing rewrites the region
before the new buffer is sealed) and verify them, readers of other regions
and deletes go on, other writers wait for the new buffer, and the result is
reconciled under the lock again (a block deleted or dropped meanwhile is
left out; a reader that finds a block moved reads it where it is now).

Options: `NvmeConfig` (ucm/adapters/nvme/config.py).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from typing import Any, Iterator, Optional, Sequence

from ucm import _native
from ucm.adapters.base import BlockEntry, Key, PaddedReads, RangeReads, Status
from ucm.adapters.nvme import format as fmt
from ucm.adapters.nvme.config import NvmeConfig
from ucm.adapters.nvme.format import (ALIGN, CHUNK_SUM, FooterEntry, align_up as _align_up,
                                      footer_bytes as _footer_bytes, n_chunks as _n_chunks)
from ucm.adapters.nvme.reads import NvmeReads
from ucm.adapters.nvme.reclaim import read_back
from ucm.adapters.nvme.recovery import NvmeRecovery
from ucm.adapters.nvme.regions import Loc, Region, choose_victim
from ucm.adapters.nvme.writer import WriteBuffer, write_region
from ucm.buffers import byte_view
from ucm.errors import ArgumentError, ClosedError
from ucm.adapters.scratch import ScratchPool

log = logging.getLogger(__name__)


def _cost(loc: Loc) -> int:
    """What the block at `loc` counts in its region's live bytes (and so in
    `used_bytes`): the same figure when it is added and when it leaves."""
    return fmt.block_footprint(loc.length, len(loc.chunks))


class NvmeAdapter(NvmeReads, NvmeRecovery, RangeReads, PaddedReads):
    """Blocks in a log of fixed-size regions, written with O_DIRECT.

    Lock order: `_lock` (and `_cond` on it), then nothing. Never held across
    device I/O or bulk copies: puts copy, gets read, the sealer writes and a
    reclaiming writer reads its victim region with it released."""

    name = "nvme"
    kv_medium = "DISK"
    Config = NvmeConfig
    read_unit = ALIGN  # PaddedReads: every block's extent on the medium is whole pages

    def __init__(self, capacity_bytes: int, config: NvmeConfig, device: Any = None) -> None:
        """`device`: the positional I/O engine (`read_batch` / `write_batch`
        returning bytes moved or -errno per request); by default the native
        core's `IoEngine(config.io_threads)`. Wrapping one injects faults
        (ucm.adapters.faults.FaultyDevice)."""
        self.config = config
        rs = config.region_size
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._path, self._fd, self.direct_io, medium_bytes = self._open(config.path, capacity_bytes)
        n_regions = medium_bytes // rs
        if n_regions < 2:
            raise ArgumentError(
                f"nvme: capacity {capacity_bytes} bytes holds {n_regions} region(s) of {rs} bytes; need >= 2")
        self.n_regions = n_regions
        self._capacity = int(n_regions * rs * config.usable_fraction)
        self._io = device if device is not None else _native.IoEngine(config.io_threads)
        self._scratch = ScratchPool()  # reads that cannot land in place (reads.py)
        self._regions = [Region() for _ in range(n_regions)]
        self._index: dict[Key, Loc] = {}
        self._mem: dict[int, WriteBuffer] = {}  # region -> buffer holding it in memory
        self._free_regions: list[int] = []
        self._spare: list[WriteBuffer] = []
        for _ in range(min(config.write_buffers, n_regions)):
            mem = mmap.mmap(-1, rs)
            _native.prefault(mem)  # appends then copy at memory speed, without page faults
            self._spare.append(WriteBuffer(mem, memoryview(mem)))
        self._open_buf: Optional[WriteBuffer] = None
        self._seq = 0
        self._dropped: list[Key] = []
        self._opening = False  # a writer is reading back a reclaimed region for a new buffer
        self._failed_at = -1e18
        self._stats = {"bytes_written": 0, "bytes_read": 0, "regions_sealed": 0, "regions_reclaimed": 0,
                       "reinserted": 0, "dropped": 0, "corrupt": 0, "write_errors": 0, "read_errors": 0,
                       "recovered_blocks": 0, "too_large": 0, "range_reads": 0}
        self._recover()
        self._seal_queue: list[WriteBuffer] = []
        self._sealer = threading.Thread(target=self._seal_loop, name="ucm-nvme-sealer", daemon=True)
        self._sealer.start()

    # ---- write path --------------------------------------------------------
    def put(self, keys: Sequence[Key], blobs: Sequence[Any],
            parents: Optional[Sequence[Optional[Key]]] = None) -> list[Status]:
        """Stores each blob; `parents[i]` (None for a root) is written into
        the footer with keys[i], so that a restart rebuilds the prefix tree."""
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        if parents is None:
            parents = [None] * len(keys)
        elif len(parents) != len(keys):
            raise ArgumentError(f"put: {len(keys)} keys but {len(parents)} parents")
        for p in parents:
            if p is not None and not (isinstance(p, bytes) and len(p) == fmt.KEY_BYTES):
                raise ArgumentError(f"put: a parent must be None or {fmt.KEY_BYTES} bytes, got {p!r:.40}")
        rs = self.config.region_size
        cb = self.config.chunk_bytes
        out: list[Status] = []
        for key, blob, parent in zip(keys, blobs, parents):
            src = byte_view(blob, what="blob")
            n = len(src)
            if n == 0:
                raise ArgumentError("nvme: a blob must not be empty")
            if _align_up(n) + _footer_bytes(1, _n_chunks(n, cb)) > rs:  # this tier cannot hold it: a refusal
                with self._lock:
                    self._stats["too_large"] += 1
                    first = self._stats["too_large"] == 1
                if first:
                    log.warning("nvme: a block of %d bytes does not fit a region of %d bytes (region_size); "
                                "such blocks are not kept on %s", n, rs, self.config.path)
                out.append(Status.NO_SPACE)
                continue
            csum, chunks = fmt.block_checksums(src, cb)
            with self._lock:
                self._check_open()
                if key in self._index:
                    out.append(Status.OK)
                    continue
                if time.monotonic() - self._failed_at < self.config.retry_after_s:
                    out.append(Status.NO_SPACE)
                    continue
                buf = self._writable_buffer(n)
                if buf is None:
                    out.append(Status.NO_SPACE)
                    continue
                off = buf.end
                buf.end = off + _align_up(n)
                buf.readers += 1
            try:
                _native.copy(buf.view[off:off + n], src)
            except BaseException:
                with self._lock:  # the hole stays unused; the buffer may be sealed
                    buf.readers -= 1
                    self._cond.notify_all()
                raise
            with self._lock:
                buf.readers -= 1
                if key in self._index:  # a concurrent put of the key landed first: this copy is a hole
                    self._cond.notify_all()
                    out.append(Status.OK)
                    continue
                buf.entries.append(FooterEntry(key, parent, off, n, csum, cb, chunks))
                buf.n_chunks += len(chunks) // CHUNK_SUM
                loc = self._index[key] = Loc(buf.region, off, n, csum, parent, cb, chunks)
                reg = self._regions[buf.region]
                reg.live.add(key)
                reg.live_bytes += _cost(loc)
                self._cond.notify_all()
            out.append(Status.OK)
        return out

    def _fits(self, buf: WriteBuffer, n: int) -> bool:
        chunks = buf.n_chunks + _n_chunks(n, self.config.chunk_bytes)
        return buf.end + _align_up(n) + _footer_bytes(len(buf.entries) + 1, chunks) <= self.config.region_size

    def _writable_buffer(self, n: int) -> Optional[WriteBuffer]:
        """The open buffer with room for `n` bytes, sealing and opening
        buffers as needed. Called with the lock held; may wait, and lets the
        lock go while it reads back a reclaimed region (one writer opens a
        buffer at a time: the others wait for it)."""
        deadline = time.monotonic() + self.config.put_timeout_s
        while True:
            buf = self._open_buf
            if buf is not None and self._fits(buf, n):
                return buf
            if buf is not None:
                self._queue_seal(buf)
                self._open_buf = None
            while not self._spare or self._opening:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            if self._open_buf is not None:  # another writer opened one meanwhile
                continue
            taken = self._take_region()
            if taken is None:
                return None
            region, reclaimed = taken
            buf = self._spare.pop()
            self._seq += 1
            buf.region, buf.seq, buf.end, buf.entries, buf.n_chunks = region, self._seq, 0, [], 0
            if reclaimed:
                self._opening = True
                try:
                    self._reclaim_into(buf, reserve=n)
                except BaseException:
                    self._spare.append(buf)  # the region keeps its blocks on the medium
                    raise
                finally:
                    self._regions[region].reclaiming = False
                    self._opening = False
                    self._cond.notify_all()
            self._mem[region] = buf
            self._open_buf = buf

    def _take_region(self) -> Optional[tuple[int, bool]]:
        """A region for a new buffer, and whether it is reclaimed (its live
        blocks are still in it). Called with the lock held."""
        if self._free_regions:
            return self._free_regions.pop(), False
        victim = choose_victim(self._regions, self._mem)
        if victim is None:
            return None
        self._regions[victim].reclaiming = True  # cleared by _reclaim_into, back under the lock
        self._stats["regions_reclaimed"] += 1
        return victim, True

    def _reclaim_into(self, buf: WriteBuffer, reserve: int) -> None:
        """Re-inserts the live blocks of `buf`'s (reclaimed) region at the
        head of the buffer, leaving room for a blob of `reserve` bytes so
        that the writer always progresses; those that do not fit, or come
        back bad, are dropped. Called with the lock held; reads the region
        and copies into `buf` without it. Meanwhile the region's blocks stay
        readable from the medium (nothing rewrites it before `buf` is
        sealed), and `buf` is nobody else's (neither open nor in `_mem`).
        Back under the lock, a block deleted or dropped meanwhile is left
        out (its copy is a hole in the buffer)."""
        victim = buf.region
        reg = self._regions[victim]  # marked reclaiming by _take_region
        live = sorted(((k, self._index[k]) for k in reg.live), key=lambda kl: kl[1].offset)
        if not live:
            reg.live_bytes = 0
            return
        self._lock.release()  # the victim's read and copies run with no lock held
        try:
            at, _, placed, refused = read_back(self._io, self._fd, buf, live, reserve, self.config.region_size,
                                               self.config.io_chunk, self.config.chunk_bytes)
        finally:
            self._lock.acquire()
        reg.live, reg.live_bytes = set(), 0
        buf.end = at
        for key, loc, new in placed:
            if self._index.get(key) is not loc:  # deleted, or dropped by a reader, meanwhile
                continue
            buf.entries.append(FooterEntry(key, new.parent, new.offset, new.length, new.checksum, new.chunk_bytes,
                                           new.chunks))
            buf.n_chunks += len(new.chunks) // CHUNK_SUM
            self._index[key] = new
            reg.live.add(key)
            reg.live_bytes += _cost(new)
            self._stats["reinserted"] += 1
        for key, loc, why in refused:
            if self._index.get(key) is not loc:
                continue
            del self._index[key]
            self._dropped.append(key)
            self._stats["dropped"] += 1
            if why != "room":
                self._stats[why] += 1

    def _queue_seal(self, buf: WriteBuffer) -> None:
        buf.sealing = True
        self._seal_queue.append(buf)
        self._cond.notify_all()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Seals the open buffer and waits until every queued region is on
        the medium. Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._open_buf is not None and self._open_buf.entries:
                self._queue_seal(self._open_buf)
                self._open_buf = None
            while self._seal_queue or any(b.sealing for b in self._mem.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _seal_loop(self) -> None:
        while True:
            with self._lock:
                while not self._seal_queue and not self._closed:
                    self._cond.wait()
                if not self._seal_queue:
                    return
                buf = self._seal_queue[0]
                while buf.readers:
                    self._cond.wait()
                entries = list(buf.entries)
                invalidate = self._regions[buf.region].has_footer
            try:
                err = write_region(self._io, self._fd, buf, entries, invalidate, self.config.region_size,
                                   self.config.io_chunk)
            except Exception:  # the sealer must live on: the region is a failed write
                log.exception("nvme: sealing region %d failed", buf.region)
                err = -errno.EIO
            with self._lock:
                while buf.readers:  # copies out of the buffer finish before it is reused
                    self._cond.wait()
                self._seal_queue.pop(0)
                buf.sealing = False
                reg = self._regions[buf.region]
                if err == 0:
                    reg.seq = buf.seq
                    reg.has_footer = True
                    self._stats["regions_sealed"] += 1
                    self._stats["bytes_written"] += buf.end
                else:
                    self._stats["write_errors"] += 1
                    self._failed_at = time.monotonic()
                    log.warning("nvme: writing region %d failed: %s", buf.region, os.strerror(-err))
                    for key in list(reg.live):
                        loc = self._index.get(key)
                        if loc is not None and loc.region == buf.region:
                            del self._index[key]
                            self._dropped.append(key)
                            self._stats["dropped"] += 1
                    reg.live, reg.live_bytes = set(), 0
                    reg.has_footer = reg.has_footer and not invalidate
                    self._free_regions.insert(0, buf.region)
                del self._mem[buf.region]
                self._spare.append(buf)
                self._cond.notify_all()

    def _drop_locked(self, key: Key) -> None:
        loc = self._index.pop(key, None)
        if loc is None:
            return
        reg = self._regions[loc.region]
        if key in reg.live:
            reg.live.discard(key)
            reg.live_bytes -= _cost(loc)
        self._dropped.append(key)
        self._stats["dropped"] += 1

    # ---- the rest of the contract ------------------------------------------
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        out = []
        with self._lock:
            for key in keys:
                loc = self._index.pop(key, None)
                if loc is None:
                    out.append(False)
                    continue
                reg = self._regions[loc.region]
                reg.live.discard(key)
                reg.live_bytes -= _cost(loc)
                out.append(True)
        return out

    def size_of(self, key: Key) -> Optional[int]:
        with self._lock:
            loc = self._index.get(key)
            return None if loc is None else loc.length

    def iter_keys(self) -> Iterator[Key]:
        with self._lock:
            return iter(list(self._index))

    def iter_entries(self) -> Iterator[BlockEntry]:
        """Every block held with its size and the parent recorded at put."""
        with self._lock:
            return iter([BlockEntry(k, loc.length, loc.parent) for k, loc in self._index.items()])

    def put_with_parents(self, keys: Sequence[Key], blobs: Sequence[Any],
                         parents: Sequence[Optional[Key]]) -> list[Status]:
        return self.put(keys, blobs, parents)

    def drain_dropped(self) -> list[Key]:
        with self._lock:
            out, self._dropped = self._dropped, []
            return out

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(r.live_bytes for r in self._regions)

    def footprint_bytes(self, size: int) -> int:
        """What a block of `size` bytes put now adds to `used_bytes`."""
        return fmt.block_footprint(size, _n_chunks(size, self.config.chunk_bytes) * CHUNK_SUM)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats, blocks=len(self._index), regions=self.n_regions,
                        free_regions=len(self._free_regions), direct_io=self.direct_io, path=self._path)

    def close(self) -> None:
        """Seals what is buffered (best effort) and closes the medium."""
        with self._lock:
            if self._closed:
                return
        self.flush(timeout_s=self.config.put_timeout_s)
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        self._sealer.join(timeout=self.config.put_timeout_s)
        os.close(self._fd)
        self._scratch.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("nvme adapter used after close()")

