"""The key -> slot bookkeeping of a slab-arena adapter (`dram`, `hbm`).

A `SlotTable` owns a `SlabArena` (ucm.adapters.slab) and maps keys to the
slots carved from it: reserved slots (being written, invisible) and
committed ones (visible), each with a lease count. A slot deleted while
leased is `doomed` and freed on its last release, so that a reader's bytes
never change under it. The adapter moves the bytes (a shared-memory view, a
device tensor); the table only says which slot is whose.

Thread-safe: one lock guards the map and the arena; no method copies bytes
or calls out while holding it, except `victims`, which runs the owner's
`acceptable` under it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ucm.adapters.base import Key, SlotVictims
from ucm.adapters.slab import SlabArena
from ucm.errors import ClosedError


@dataclass(slots=True)
class Slot:
    offset: int
    length: int
    unit: int  # first extent of the arena unit holding it
    leases: int = 0
    doomed: bool = False  # deleted while leased: free on last release


class SlotTable:
    """Reserved and committed slots of one arena, by key."""

    def __init__(self, arena: SlabArena, owner: str) -> None:
        self.arena = arena
        self._owner = owner  # the adapter's name, for errors
        self._lock = threading.Lock()
        self._index: dict[Key, Slot] = {}  # committed
        self._pending: dict[Key, Slot] = {}  # reserved, not yet committed
        self._by_unit: dict[int, set[Key]] = {}  # arena unit -> its committed keys
        self._closed = False

    # ---- writing: reserve, then commit or abort ----------------------------
    def reserve(self, key: Key, size: int) -> Optional[Slot]:
        """A fresh slot of `size` bytes for `key`, invisible until `commit`;
        None when the key is committed or reserved, or the arena has no
        slot of that size. Raises ClosedError after close."""
        with self._lock:
            self._check_open()
            if key in self._index or key in self._pending:
                return None
            off = self.arena.alloc(size)
            if off is None:
                return None
            slot = self._pending[key] = Slot(off, size, self.arena.extent_of(off))
            return slot

    def commit(self, key: Key) -> Optional[Slot]:
        """Makes the reserved slot of `key` visible; None without one."""
        with self._lock:
            slot = self._pending.pop(key, None)
            if slot is not None:
                self._index[key] = slot
                self._by_unit.setdefault(slot.unit, set()).add(key)
            return slot

    def abort(self, key: Key) -> None:
        with self._lock:
            slot = self._pending.pop(key, None)
            if slot is not None and not self._closed:
                self.arena.free(slot.offset, slot.length)

    # ---- reading: lease, then release --------------------------------------
    def lease(self, key: Key) -> Optional[Slot]:
        """The committed slot of `key`, not to be reused until `release`;
        None on a miss. Raises ClosedError after close."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is not None:
                slot.leases += 1
            return slot

    def release(self, slot: Slot) -> None:
        with self._lock:
            slot.leases -= 1
            if slot.doomed and slot.leases == 0 and not self._closed:
                self.arena.free(slot.offset, slot.length)

    # ---- lookups -----------------------------------------------------------
    def check_open(self) -> None:
        with self._lock:
            self._check_open()

    def present(self, key: Key, reserved: bool = False) -> bool:
        """True when `key` is committed (or, with `reserved`, reserved)."""
        with self._lock:
            return key in self._index or (reserved and key in self._pending)

    def find(self, key: Key) -> Optional[Slot]:
        """The committed or reserved slot of `key`, or None."""
        with self._lock:
            return self._index.get(key) or self._pending.get(key)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def size_of(self, key: Key) -> Optional[int]:
        with self._lock:
            slot = self._index.get(key)
            return None if slot is None else slot.length

    def keys(self) -> list[Key]:
        """A snapshot of the committed keys."""
        with self._lock:
            return list(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Removes each committed key (True if it was); a leased slot is
        freed on its last release."""
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
                    self.arena.free(slot.offset, slot.length)
                out.append(True)
        return out

    # ---- accounting --------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self.arena.used_bytes

    def footprint_bytes(self, size: int) -> int:
        """Arena bytes a blob of `size` costs: its slot's share of its unit
        (what `used_bytes` counts)."""
        return self.arena.footprint_bytes(size)

    def arena_stats(self) -> dict[str, int]:
        with self._lock:
            a = self.arena
            return {"blocks": len(self._index), "extent_bytes": a.extent_bytes,
                    "extents": a.extent_count, "extents_free": a.free_extents}

    # ---- what to evict for a slot ------------------------------------------
    def victims(self, size: int,
                acceptable: Optional[Callable[[tuple[Key, ...]], bool]] = None) -> SlotVictims:
        """See `DramAdapter.victims_for`."""
        with self._lock:
            self._check_open()
            arena = self.arena
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

    # ---- closing -----------------------------------------------------------
    def close(self) -> bool:
        """Forgets every slot; True the first time (the owner then frees
        its memory), False when already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._index.clear()
            self._pending.clear()
            self._by_unit.clear()
            return True

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._owner} adapter used after close()")
