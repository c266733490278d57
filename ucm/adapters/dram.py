"""`dram`: a slab arena in shared memory.

The arena is one file in a tmpfs directory (`/dev/shm` by default), mode
0600, mapped shared, so that other processes of the same user (engine
workers, through the service) can map it and copy in and out of slots
directly. Slots have fixed sizes per payload size, carved from extents
that each size class takes from a free pool and gives back when empty
(ucm.adapters.slab, `extent_bytes`); a table maps key -> slot
(ucm.adapters.slots). Leases guard readers: a slot being read is never
reused, a deleted slot is freed when its last lease is released. Writers
reserve a slot, fill it, then commit it; until commit it is invisible. These
are the `SharedSlots` ability (ucm.adapters.base); byte ranges of a blob are
read in place (`RangeReads`).

When `reserve` finds no slot of a size although the owner's byte count has
room (the free bytes sit in extents of other classes), `victims_for(size)`
names the committed blocks whose eviction makes that slot: the owner (the
cache) evicts them through its placement and reserves again.

Thread-safe: the slot table's lock guards the index and the arena; copies
run outside it.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from pydantic import Field, field_validator

from ucm import _native
# Lease and SlotVictims live in base; `from ucm.adapters.dram import Lease, SlotVictims` still works.
from ucm.adapters.base import (AdapterConfig, Key, Lease, RangeReads, SharedSlots, SlotVictims, Status,
                               check_range_args)
from ucm.adapters.slab import DEFAULT_EXTENT_BYTES, SlabArena
from ucm.adapters.slots import SlotTable
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError
from ucm.config.sizes import parse_size

SLOT_ALIGN = 4096  # slots start on page boundaries


class DramConfig(AdapterConfig):
    path: str = "/dev/shm"  # directory of the shared-memory file (tmpfs)
    prefault: bool = True  # touch every page at start so copies take no faults
    copy_threads: int = Field(default=1, ge=1, le=64)  # threads per large copy
    # Largest unit of space a size class takes or gives back; a small arena
    # is cut into smaller extents (at least 8). A slot larger than an
    # extent takes a run of contiguous extents.
    extent_bytes: int = DEFAULT_EXTENT_BYTES

    @field_validator("extent_bytes", mode="before")
    @classmethod
    def _extent(cls, v: Any) -> int:
        n = parse_size(v)
        if n < SLOT_ALIGN or n % SLOT_ALIGN:
            raise ValueError(f"must be a positive multiple of {SLOT_ALIGN} bytes, got {n}")
        return n


def _free_bytes(fd: int) -> int:
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class DramAdapter(SharedSlots, RangeReads):
    """Blobs in fixed-size slots of a shared-memory arena."""

    name = "dram"
    kv_medium = "CPU_TIER1"
    Config = DramConfig

    def __init__(self, capacity_bytes: int, config: Optional[DramConfig] = None) -> None:
        self.config = config or DramConfig()
        if capacity_bytes <= 0:
            raise ArgumentError(f"dram: capacity_bytes must be > 0, got {capacity_bytes}")
        self._slots = SlotTable(SlabArena(capacity_bytes, align=SLOT_ALIGN, extent_bytes=self.config.extent_bytes),
                                "dram")
        self._stats_lock = threading.Lock()
        self._segment_path = os.path.join(self.config.path,
                                          f"ucm-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(self._segment_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise AdapterError(f"dram: cannot create shared-memory file in {self.config.path!r}: {exc}") from exc
        # The file goes with the adapter even when close() is never called
        # (a failed construction, an owner that was garbage collected).
        self._unlink = weakref.finalize(self, _unlink_quietly, self._segment_path)
        try:
            os.ftruncate(fd, capacity_bytes)
            self._reserve_memory(fd, capacity_bytes)
            self._mmap = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, AdapterError) as exc:
            os.close(fd)
            self._unlink()
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"dram: cannot map {capacity_bytes} bytes at {self._segment_path!r}: {exc}") from exc
        os.close(fd)
        self._view = memoryview(self._mmap)
        if self.config.prefault:
            _native.prefault(self._view)
        self._stats = {"bytes_in": 0, "bytes_out": 0}

    def _reserve_memory(self, fd: int, capacity_bytes: int) -> None:
        """A file in a tmpfs smaller than the capacity (a container's 64 MiB
        /dev/shm) would die of SIGBUS at the first write past what the tmpfs
        holds, in the service or in an engine copying into the arena. So
        the memory is allocated now (`prefault`), or at least checked free."""
        path = self.config.path
        hint = (f"lower the dram tier's capacity or give {path!r} more room (a container: "
                f"docker run --shm-size=SIZE or --ipc=host)")
        if self.config.prefault:
            try:
                os.posix_fallocate(fd, 0, capacity_bytes)
                return
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise AdapterError(f"dram: {path!r} cannot hold the arena's {capacity_bytes} bytes "
                                       f"({_free_bytes(fd)} free): {hint}") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        free = _free_bytes(fd)
        if free < capacity_bytes:
            raise AdapterError(f"dram: {path!r} has {free} bytes free, the arena needs {capacity_bytes}: {hint}")

    # ---- SharedSlots (zero-copy users: the cache, the service) -------------
    @property
    def segment_path(self) -> str:
        return self._segment_path

    def segment_view(self) -> memoryview:
        self._slots.check_open()
        return self._view

    def reserve(self, key: Key, size: int) -> Optional[memoryview]:
        """A writable view of a fresh slot for `key`, or None when the arena
        is full or the key is already present/reserved. Commit or abort it."""
        slot = self._slots.reserve(key, size)
        return None if slot is None else self._view[slot.offset:slot.offset + size]

    def victims_for(self, size: int,
                    acceptable: Optional[Callable[[tuple[Key, ...]], bool]] = None) -> SlotVictims:
        """What to evict when `reserve(key, size)` found no slot: the keys of
        the cheapest arena unit of another size class that still has free
        slots (fewest live blocks); else any one block of the size's own
        class, when it has units; else the blocks of the cheapest unit (or
        run of units, for a slot larger than an extent) of any class. Units
        holding a leased, reserved or doomed slot are never named, nor keys
        that `acceptable` (the owner's judgement: pins, prefix order; asked
        per unit with its keys, per key for the own class) refuses. Empty
        when nothing can be freed. Evicting them and reserving again is the
        caller's move (this lock is not held between the two). Lock order:
        the owner may hold its own locks; `acceptable` runs under this one
        and must not call the adapter."""
        return self._slots.victims(size, acceptable)

    def commit(self, key: Key) -> bool:
        slot = self._slots.commit(key)
        if slot is None:
            return False
        with self._stats_lock:
            self._stats["bytes_in"] += slot.length
        return True

    def abort(self, key: Key) -> None:
        self._slots.abort(key)

    def lease(self, key: Key) -> Optional[Lease]:
        """The committed slot of `key` for reading (None on a miss); it cannot
        be reused until `release(lease)`."""
        slot = self._slots.lease(key)
        if slot is None:
            return None
        return Lease(key, slot.offset, slot.length, self._view[slot.offset:slot.offset + slot.length], slot)

    def release(self, lease: Lease) -> None:
        lease.view.release()
        self._slots.release(lease.record)

    def slot_offset(self, key: Key) -> Optional[tuple[int, int]]:
        """(offset, length) inside the segment file of the committed or
        reserved slot of `key`."""
        slot = self._slots.find(key)
        return None if slot is None else (slot.offset, slot.length)

    # ---- RangeReads --------------------------------------------------------
    def get_range(self, keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[Any]) -> list[Status]:
        check_range_args(keys, offsets, dsts)
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        return [self._copy_out(key, view, off) for key, off, view in zip(keys, offsets, views)]

    def _copy_out(self, key: Key, view: memoryview, offset: Optional[int]) -> Status:
        """Copies the blob of `key` (offset None: all of it, whose size must
        be the view's) or the range at `offset` into `view`, under a lease."""
        lease = self.lease(key)
        if lease is None:
            return Status.NOT_FOUND
        try:
            src = lease.view
            if offset is None:
                if len(src) != len(view):
                    return Status.CORRUPT
            elif offset + len(view) > len(src):
                return Status.CORRUPT
            else:
                src = src[offset:offset + len(view)]
            _native.copy(view, src, self.config.copy_threads)
            with self._stats_lock:
                self._stats["bytes_out"] += len(view)
            return Status.OK
        finally:
            self.release(lease)

    # ---- StorageAdapter ----------------------------------------------------
    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        out: list[Status] = []
        for key, blob in zip(keys, blobs):
            src = byte_view(blob, what="blob")
            self._slots.check_open()
            if self._slots.present(key):
                out.append(Status.OK)
                continue
            dst = self.reserve(key, len(src))
            if dst is None:
                out.append(Status.OK if self._slots.present(key, reserved=True) else Status.NO_SPACE)
                continue
            try:
                _native.copy(dst, src, self.config.copy_threads)
            except BaseException:
                dst.release()
                self.abort(key)
                raise
            dst.release()
            self.commit(key)
            out.append(Status.OK)
        return out

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        return [self._copy_out(key, view, None) for key, view in zip(keys, views)]

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self._slots.contains(keys)

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        return self._slots.delete(keys)

    def size_of(self, key: Key) -> Optional[int]:
        return self._slots.size_of(key)

    def iter_keys(self) -> Iterator[Key]:
        return iter(self._slots.keys())

    @property
    def capacity_bytes(self) -> int:
        return self._slots.arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    def footprint_bytes(self, size: int) -> int:
        """Arena bytes a blob of `size` bytes costs: its slot's share of its
        extent (what `used_bytes` counts), so that a byte count of the tier
        runs out when its extents do."""
        return self._slots.footprint_bytes(size)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            counts = dict(self._stats)
        return dict(counts, segment=self._segment_path, **self._slots.arena_stats())

    def close(self) -> None:
        if not self._slots.close():
            return
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        self._unlink()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
