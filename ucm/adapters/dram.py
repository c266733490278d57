"""`dram`: a slab arena in shared memory.

The arena is one file in a tmpfs directory (`/dev/shm` by default), mode
0600, mapped shared, so that other processes of the same user (engine
workers, through the service) can map it and copy in and out of slots
directly. Slots have fixed sizes per payload size, carved from extents
that each size class takes from a free pool and gives back when empty
(ucm.adapters.slab, `extent_bytes`); an index maps key -> slot. Leases
guard readers: a slot being read is never reused, a deleted slot is freed
when its last lease is released. Writers reserve a slot, fill it, then
commit it; until commit it is invisible.

When `reserve` finds no slot of a size although the owner's byte count has
room (the free bytes sit in extents of other classes), `victims_for(size)`
names the committed blocks whose eviction makes that slot: the owner (the
cache) evicts them through its placement and reserves again.

Thread-safe: one lock guards the index and the arena; copies run outside it.
"""
from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from pydantic import Field, field_validator

from ucm import _native
from ucm.adapters.base import AdapterConfig, Key, Status, StorageAdapter
from ucm.adapters.slab import DEFAULT_EXTENT_BYTES, SlabArena
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError, ClosedError
from ucm.sizes import parse_size

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


@dataclass(slots=True)
class _Slot:
    offset: int
    length: int
    unit: int  # first extent of the arena unit holding it
    leases: int = 0
    doomed: bool = False  # deleted while leased: free on last release


@dataclass(slots=True)
class Lease:
    key: Key
    slot: _Slot
    view: memoryview  # read-only use: the committed blob


@dataclass(frozen=True, slots=True)
class SlotVictims:
    """Blocks to evict so that a slot can be reserved (`victims_for`).
    `any_one`: evicting any one of `keys` frees a slot of the size's own
    class (the owner's policy picks which); otherwise every key must go:
    together they empty the arena units the size needs."""

    keys: tuple[Key, ...]
    any_one: bool


def _free_bytes(fd: int) -> int:
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class DramAdapter(StorageAdapter):
    """Blobs in fixed-size slots of a shared-memory arena."""

    name = "dram"
    Config = DramConfig

    def __init__(self, capacity_bytes: int, config: Optional[DramConfig] = None) -> None:
        self.config = config or DramConfig()
        if capacity_bytes <= 0:
            raise ArgumentError(f"dram: capacity_bytes must be > 0, got {capacity_bytes}")
        self._arena = SlabArena(capacity_bytes, align=SLOT_ALIGN, extent_bytes=self.config.extent_bytes)
        self._lock = threading.Lock()
        self._index: dict[Key, _Slot] = {}
        self._pending: dict[Key, _Slot] = {}  # reserved, not yet committed
        self._by_unit: dict[int, set[Key]] = {}  # arena unit -> its committed keys
        self.segment_path = os.path.join(self.config.path, f"ucm-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(self.segment_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise AdapterError(f"dram: cannot create shared-memory file in {self.config.path!r}: {exc}") from exc
        # The file goes with the adapter even when close() is never called
        # (a failed construction, an owner that was garbage collected).
        self._unlink = weakref.finalize(self, _unlink_quietly, self.segment_path)
        try:
            os.ftruncate(fd, capacity_bytes)
            self._reserve_memory(fd, capacity_bytes)
            self._mmap = mmap.mmap(fd, capacity_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, AdapterError) as exc:
            os.close(fd)
            self._unlink()
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"dram: cannot map {capacity_bytes} bytes at {self.segment_path!r}: {exc}") from exc
        os.close(fd)
        self._view = memoryview(self._mmap)
        if self.config.prefault:
            _native.prefault(self._view)
        self._closed = False
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

    # ---- slot-level API (zero-copy users: the cache, the service) ----------
    def reserve(self, key: Key, size: int) -> Optional[memoryview]:
        """A writable view of a fresh slot for `key`, or None when the arena
        is full or the key is already present/reserved. Commit or abort it."""
        with self._lock:
            self._check_open()
            if key in self._index or key in self._pending:
                return None
            off = self._arena.alloc(size)
            if off is None:
                return None
            self._pending[key] = _Slot(off, size, self._arena.extent_of(off))
            return self._view[off:off + size]

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
        with self._lock:
            self._check_open()
            arena = self._arena
            ok = acceptable or (lambda keys: True)

            def releasable(head: int) -> bool:
                keys = tuple(self._by_unit.get(head, ()))
                return (arena.live(head) == len(keys) and all(self._index[k].leases == 0 for k in keys)
                        and ok(keys))

            heads = arena.release_candidates(size, releasable, partial_only=True)
            if heads is None and arena.has_class(size):
                cls = arena.slot_bytes(size)
                own = tuple(k for u in arena.units() if u.slot_bytes == cls
                            for k in self._by_unit.get(u.head, ()) if self._index[k].leases == 0 and ok((k,)))
                if own:
                    return SlotVictims(own, any_one=True)
            if heads is None:
                heads = arena.release_candidates(size, releasable)
            keys = tuple(k for h in heads or () for k in self._by_unit.get(h, ()))
            return SlotVictims(keys, any_one=False)

    def commit(self, key: Key) -> bool:
        with self._lock:
            slot = self._pending.pop(key, None)
            if slot is None:
                return False
            self._index[key] = slot
            self._by_unit.setdefault(slot.unit, set()).add(key)
            self._stats["bytes_in"] += slot.length
            return True

    def abort(self, key: Key) -> None:
        with self._lock:
            slot = self._pending.pop(key, None)
            if slot is not None:
                self._arena.free(slot.offset, slot.length)

    def lease(self, key: Key) -> Optional["Lease"]:
        """The committed slot of `key` for reading (None on a miss); it cannot
        be reused until `release(lease)`."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is None:
                return None
            slot.leases += 1
            return Lease(key, slot, self._view[slot.offset:slot.offset + slot.length])

    def release(self, lease: "Lease") -> None:
        lease.view.release()
        with self._lock:
            slot = lease.slot
            slot.leases -= 1
            if slot.doomed and slot.leases == 0 and not self._closed:
                self._arena.free(slot.offset, slot.length)

    def slot_offset(self, key: Key) -> Optional[tuple[int, int]]:
        """(offset, length) inside the segment file of the committed or
        reserved slot of `key`."""
        with self._lock:
            slot = self._index.get(key) or self._pending.get(key)
            return None if slot is None else (slot.offset, slot.length)

    # ---- StorageAdapter ----------------------------------------------------
    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        out: list[Status] = []
        for key, blob in zip(keys, blobs):
            src = byte_view(blob, what="blob")
            with self._lock:
                self._check_open()
                present = key in self._index
            if present:
                out.append(Status.OK)
                continue
            dst = self.reserve(key, len(src))
            if dst is None:
                with self._lock:
                    present = key in self._index or key in self._pending
                out.append(Status.OK if present else Status.NO_SPACE)
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
        out: list[Status] = []
        for key, dst in zip(keys, dsts):
            view = byte_view(dst, writable=True, what="destination")
            lease = self.lease(key)
            if lease is None:
                out.append(Status.NOT_FOUND)
                continue
            src = lease.view
            try:
                if len(src) != len(view):
                    out.append(Status.CORRUPT)
                    continue
                _native.copy(view, src, self.config.copy_threads)
                with self._lock:
                    self._stats["bytes_out"] += len(view)
                out.append(Status.OK)
            finally:
                self.release(lease)
        return out

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        out = []
        with self._lock:
            for key in keys:
                slot = self._index.pop(key, None)
                if slot is None:
                    out.append(False)
                    continue
                unit = self._by_unit[slot.unit]
                unit.discard(key)
                if not unit:
                    del self._by_unit[slot.unit]
                if slot.leases:
                    slot.doomed = True
                else:
                    self._arena.free(slot.offset, slot.length)
                out.append(True)
        return out

    def size_of(self, key: Key) -> Optional[int]:
        with self._lock:
            slot = self._index.get(key)
            return None if slot is None else slot.length

    def iter_keys(self) -> Iterator[Key]:
        with self._lock:
            keys = list(self._index)
        return iter(keys)

    @property
    def capacity_bytes(self) -> int:
        return self._arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._arena.used_bytes

    def slot_bytes(self, size: int) -> int:
        """Arena bytes a blob of `size` bytes costs: its slot's share of its
        extent (what `used_bytes` counts), so that a byte count of the tier
        runs out when its extents do."""
        return self._arena.footprint_bytes(size)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            a = self._arena
            return dict(self._stats, segment=self.segment_path, blocks=len(self._index),
                        extent_bytes=a.extent_bytes, extents=a.extent_count, extents_free=a.free_extents)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._pending.clear()
            self._by_unit.clear()
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        self._unlink()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("dram adapter used after close()")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
