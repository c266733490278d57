"""`ClusterBudget`: the bytes a cluster tier's adapter may use in a shared
medium, and the keys it relies on there.

A cluster store (mooncake, redis, fs) is shared with other nodes and evicts
or loses values on its own, so an adapter cannot ask it how much of it is
"ours". The budget is what it knows instead: an index key -> payload bytes
of the values this instance stored (or found present), in least recently
used order, and the bytes they take (`footprint_bytes`: payload plus the
framing header) plus the reservations of puts in flight.

A put is reserve-then-settle: `reserve` answers per item OK (already held),
NO_SPACE (past `capacity_bytes`, after evicting least recently used keys
where asked) or None (reserved: the caller writes it), then `settle` indexes
what landed and releases the rest. A value found gone (`gone`) leaves the
index and is reported once by `drain_dropped()`; a value the owner deleted
(`forget`) leaves it unreported.

`BudgetedAdapter` is the part of the StorageAdapter contract the budget
answers (`iter_keys`, `drain_dropped`, `capacity_bytes`, `used_bytes`,
`footprint_bytes`) for an adapter that keeps its budget in `self._budget`.

Thread-safe: one lock of its own, never held while calling out, so it may be
taken under an adapter's lock (lock order: the adapter's, then this one).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

from ucm.adapters import framing
from ucm.adapters.base import Key, Status, StorageAdapter
from ucm.errors import ArgumentError


@dataclass(slots=True)
class Reservation:
    """What `reserve` decided: per item OK, NO_SPACE or None (reserved, to be
    written and settled); `todo` lists the reserved items; `victims` the keys
    evicted to make room (out of the index already; the caller removes them
    from the medium, then calls `evicted`)."""

    out: list[Optional[Status]]
    todo: list[int] = field(default_factory=list)
    victims: list[Key] = field(default_factory=list)


class ClusterBudget:
    """A key -> payload-bytes index and the bytes it (and reservations) use."""

    def __init__(self, tier: str, capacity_bytes: int, *, overhead_bytes: int = framing.HEADER_BYTES,
                 pending_is_held: bool = False, footprint: Optional[Callable[[int], int]] = None) -> None:
        """`tier` names the adapter in errors. `overhead_bytes`: stored per
        value beside its payload; or `footprint`, the bytes a value of a
        payload size takes, for a framing whose overhead grows with the
        payload (fs's chunked frames). `pending_is_held`: a put of a key
        whose put is still in flight answers OK instead of writing it again
        (fs: same bytes, atomic renames)."""
        if capacity_bytes <= 0:
            raise ArgumentError(f"{tier}: capacity_bytes must be > 0, got {capacity_bytes}")
        if overhead_bytes < 0:
            raise ArgumentError(f"{tier}: overhead_bytes must be >= 0, got {overhead_bytes}")
        self._capacity = capacity_bytes
        self._overhead = overhead_bytes
        self._footprint = footprint
        self._pending_is_held = pending_is_held
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, int] = OrderedDict()  # LRU first
        self._used = 0  # footprints of the index, plus reservations
        self._pending: dict[Key, int] = {}  # key -> reservations in flight
        self._evicting: set[Key] = set()  # evicted, not removed from the medium yet
        self._dropped: list[Key] = []
        self._gone = 0
        self._evicted = 0

    # ---- sizes -------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def footprint_bytes(self, size: int) -> int:
        """Bytes a value of `size` payload bytes takes in the budget."""
        return self._footprint(size) if self._footprint is not None else self._overhead + size

    # ---- puts --------------------------------------------------------------
    def reserve(self, keys: Sequence[Key], sizes: Sequence[int], *, only: Optional[Iterable[int]] = None,
                evict: bool = False) -> Reservation:
        """Decides each item of a put (those in `only`, by default all); the
        others stay None in `out` and are not reserved. `evict`: when an item
        does not fit, evicts least recently used keys (reported dropped)
        before answering NO_SPACE."""
        res = Reservation([None] * len(keys))
        with self._lock:
            for i in range(len(keys)) if only is None else only:
                key, need = keys[i], self.footprint_bytes(sizes[i])
                if key in self._index or (self._pending_is_held and key in self._pending):
                    res.out[i] = Status.OK
                    continue
                if self._used + need > self._capacity and evict:
                    res.victims += self._evict_locked(self._used + need - self._capacity)
                if self._used + need > self._capacity:
                    res.out[i] = Status.NO_SPACE
                    continue
                self._used += need
                self._pending[key] = self._pending.get(key, 0) + 1
                res.todo.append(i)
        return res

    def settle(self, items: Iterable[tuple[Key, int, bool]]) -> list[bool]:
        """Ends reservations: per (key, size, stored) True if the key is
        indexed now (stored, and not indexed already); otherwise its
        reservation is released."""
        out = []
        with self._lock:
            for key, size, stored in items:
                left = self._pending.get(key, 0) - 1
                if left > 0:
                    self._pending[key] = left
                else:
                    self._pending.pop(key, None)
                new = stored and key not in self._index
                if new:
                    self._index[key] = size
                else:
                    self._used -= self.footprint_bytes(size)
                out.append(new)
        return out

    def _evict_locked(self, need: int) -> list[Key]:
        victims: list[Key] = []
        freed = 0
        while self._index and freed < need:
            key, size = self._index.popitem(last=False)
            freed += self.footprint_bytes(size)
            victims.append(key)
        self._used -= freed
        self._evicting.update(victims)
        self._dropped.extend(victims)
        self._evicted += len(victims)
        return victims

    def evicted(self, victims: Iterable[Key]) -> None:
        """The evicted values are off the medium: they may be learned again."""
        with self._lock:
            self._evicting.difference_update(victims)

    # ---- what lookups find -------------------------------------------------
    def gone(self, keys: Iterable[Key], *, report: bool = False) -> None:
        """Values found missing from the medium leave the index and are
        reported dropped (`report`: reported even if not indexed, e.g. one
        this instance removed whoever stored it)."""
        with self._lock:
            for key in keys:
                self._gone_locked(key, report)

    def _gone_locked(self, key: Key, report: bool = False) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= self.footprint_bytes(size)
            self._gone += 1
        if size is not None or report:
            self._dropped.append(key)

    def forget(self, keys: Iterable[Key]) -> None:
        """Values the owner deleted leave the index, unreported."""
        with self._lock:
            for key in keys:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= self.footprint_bytes(size)

    def learn(self, key: Key, size: int) -> None:
        """A value found on the medium that the index lacked (another node's)
        joins it, unless a put or an eviction of it is in flight."""
        with self._lock:
            self._learn_locked(key, size)

    def _learn_locked(self, key: Key, size: int) -> None:
        if key not in self._index and key not in self._pending and key not in self._evicting:
            self._index[key] = size
            self._used += self.footprint_bytes(size)

    def touch(self, key: Key, size: int) -> None:
        """A value was read: most recently used now (learned if unknown)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._learn_locked(key, size)

    def resync(self, found: Iterable[tuple[Key, int]]) -> None:
        """The medium holds exactly `found` (key, payload bytes), oldest
        first: indexed keys not in it are gone (unless a put of them is in
        flight), the others are learned in that order."""
        found = dict(found)
        with self._lock:
            for key in [k for k in self._index if k not in found and k not in self._pending]:
                self._gone_locked(key)
            for key, size in found.items():
                self._learn_locked(key, size)

    # ---- queries -----------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def size_of(self, key: Key) -> Optional[int]:
        with self._lock:
            return self._index.get(key)

    def keys(self) -> list[Key]:
        """A snapshot of the indexed keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def drain_dropped(self) -> list[Key]:
        with self._lock:
            out, self._dropped = self._dropped, []
            return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._index), "gone": self._gone, "evicted": self._evicted}


class BudgetedAdapter(StorageAdapter):
    """The contract a `ClusterBudget` answers, for an adapter of a medium
    other nodes write to as well that keeps its budget in `self._budget`."""

    shared = True
    _budget: ClusterBudget

    def iter_keys(self) -> Iterator[Key]:
        """The keys this instance stored or found present (not a scan of the
        shared medium)."""
        return iter(self._budget.keys())

    def drain_dropped(self) -> list[Key]:
        return self._budget.drain_dropped()

    @property
    def capacity_bytes(self) -> int:
        return self._budget.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._budget.used_bytes

    def footprint_bytes(self, size: int) -> int:
        return self._budget.footprint_bytes(size)
