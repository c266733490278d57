"""Slot allocation for fixed-size payloads inside one linear arena, in extents.

The arena is cut into equal extents (`extent_bytes` each, smaller in an
arena too small for `MIN_EXTENTS` of them, so that it still has several).
Slots are rounded up to `align` bytes and grouped in size classes by their
rounded size. A class takes space one unit at a time from the pool of free
extents: a unit is one extent holding `extent // slot` slots, or, for a slot
larger than an extent, a run of contiguous extents holding that one slot.
Slots never straddle units. A unit goes back to the free pool as soon as
its last live slot is freed (CacheLib's slab release), so space moves
between classes: a second block size is not starved by the first.

Accounting is honest about the waste at a unit's end: `footprint_bytes`
(a slot's share of its unit) is what a slot costs, `used_bytes` sums the
footprints of live slots, and `capacity_bytes` is what the extents cover.
So the owner's byte accounting runs out exactly when the units do, except
for units that still hold free slots of another class; `release_candidates`
names the cheapest units to empty for those.

Costs: alloc and free are O(1), or O(log extents) when a unit is taken or
given back (a free-slot stack per unit, the units with a free slot per
class, a heap of free extents); a run of extents for an oversized slot and
`release_candidates` (the slow path) scan the extents. Not thread-safe: the
owning adapter holds its lock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from ucm.errors import ArgumentError

DEFAULT_EXTENT_BYTES = 64 << 20
MIN_EXTENTS = 8


def _extent_size(capacity: int, align: int, extent_bytes: int) -> int:
    """See SlabArena."""
    bound = min(extent_bytes, capacity // MIN_EXTENTS)
    if bound < align:
        return align
    if bound == extent_bytes and capacity % extent_bytes == 0:
        return extent_bytes
    top = 1 << (bound.bit_length() - 1)
    size = top
    while size > align and capacity % size:
        size //= 2
    return size if capacity % size == 0 and size * 64 >= top else top


@dataclass(slots=True)
class _Unit:
    head: int  # index of its first extent
    span: int  # extents it covers
    cls: "_Class"
    live: int = 0
    bump: int = 0  # slots carved so far
    free: list[int] = field(default_factory=list)  # offsets of freed slots


@dataclass(slots=True)
class _Class:
    slot_bytes: int
    span: int  # extents per unit
    per_unit: int  # slots per unit
    open: dict[int, None] = field(default_factory=dict)  # heads of its units with a free slot, oldest first
    units: int = 0


@dataclass(frozen=True, slots=True)
class UnitInfo:
    """One unit in use: where it is, its class, and its live slots."""

    head: int
    span: int
    slot_bytes: int
    live: int
    per_unit: int


class SlabArena:
    """Fixed-size slots in size classes, handed out from extents.

    Extents are `extent_bytes` each when that divides the arena into at
    least MIN_EXTENTS; otherwise a power of two below that bound, the
    largest that divides the arena (so that its bytes are all used and
    power-of-two block sizes fill extents without waste) unless that is
    under 1/64 of the bound, where the largest power of two under the bound
    is taken and the tail past the last whole extent is not used.
    `capacity_bytes` is what the extents cover."""

    def __init__(self, capacity_bytes: int, align: int = 4096,
                 extent_bytes: int = DEFAULT_EXTENT_BYTES) -> None:
        if capacity_bytes < 0:
            raise ArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if align <= 0 or align & (align - 1):
            raise ArgumentError(f"align must be a power of two, got {align}")
        if extent_bytes < align:
            raise ArgumentError(f"extent_bytes must be >= align ({align}), got {extent_bytes}")
        self.align = align
        size = _extent_size(capacity_bytes, align, extent_bytes)
        count = capacity_bytes // size
        self.extent_bytes = size
        self.extent_count = count
        self.capacity_bytes = count * size
        self.used_bytes = 0
        self._units: list[Optional[_Unit]] = [None] * count  # per extent: the unit covering it
        self._free_heap: list[int] = list(range(count))  # free extents, lowest first (lazy)
        self._in_heap = [True] * count
        self._free_extents = count
        self._classes: dict[int, _Class] = {}

    # ---- geometry ----------------------------------------------------------
    def slot_bytes(self, size: int) -> int:
        """The rounded slot size (the class) of a payload of `size` bytes."""
        return max(self.align, (size + self.align - 1) & ~(self.align - 1))

    def span_of(self, size: int) -> int:
        """Extents per unit of the class of `size`."""
        return max(1, -(-self.slot_bytes(size) // self.extent_bytes))

    def footprint_bytes(self, size: int) -> int:
        """What one slot for `size` bytes costs: its share of its unit."""
        slot = self.slot_bytes(size)
        span = self.span_of(size)
        return span * self.extent_bytes // max(1, (span * self.extent_bytes) // slot)

    def unit_offset(self, head: int) -> int:
        return head * self.extent_bytes

    def extent_of(self, offset: int) -> int:
        """Index of the first extent of the unit holding the slot at `offset`."""
        unit = self._units[offset // self.extent_bytes]
        if unit is None:
            raise ArgumentError(f"offset {offset} is in a free extent")
        return unit.head

    @property
    def free_extents(self) -> int:
        return self._free_extents

    # ---- slots -------------------------------------------------------------
    def alloc(self, size: int) -> Optional[int]:
        """Offset of a slot of at least `size` bytes, or None when neither its
        class nor the free pool has room."""
        if size <= 0:
            raise ArgumentError(f"slot size must be > 0, got {size}")
        cls = self._class(size)
        if cls.open:
            unit = self._units[next(iter(cls.open))]
        else:
            unit = self._take_unit(cls)
            if unit is None:
                return None
        if unit.free:
            off = unit.free.pop()
        else:
            off = self.unit_offset(unit.head) + unit.bump * cls.slot_bytes
            unit.bump += 1
        unit.live += 1
        if unit.live == cls.per_unit:
            cls.open.pop(unit.head, None)
        self.used_bytes += cls.span * self.extent_bytes // cls.per_unit  # footprint_bytes(size)
        return off

    def free(self, offset: int, size: int) -> None:
        """Gives back the slot at `offset` that `alloc(size)` handed out; its
        unit returns to the free pool when this was its last live slot."""
        idx = offset // self.extent_bytes
        unit = self._units[idx] if 0 <= idx < self.extent_count else None
        slot = self.slot_bytes(size)
        if unit is None or unit.cls.slot_bytes != slot:
            raise ArgumentError(f"free: no live slot of {slot} bytes at offset {offset}")
        cls = unit.cls
        unit.live -= 1
        self.used_bytes -= cls.span * self.extent_bytes // cls.per_unit  # footprint_bytes(size)
        if unit.live == 0:
            cls.open.pop(unit.head, None)
            cls.units -= 1
            for i in range(unit.head, unit.head + unit.span):
                self._units[i] = None
                if not self._in_heap[i]:
                    self._in_heap[i] = True
                    heapq.heappush(self._free_heap, i)
            self._free_extents += unit.span
            if cls.units == 0:
                del self._classes[cls.slot_bytes]
            return
        unit.free.append(offset)
        cls.open[unit.head] = None

    # ---- what to release ---------------------------------------------------
    def units(self) -> Iterator[UnitInfo]:
        """Every unit in use, by address."""
        i = 0
        while i < self.extent_count:
            u = self._units[i]
            if u is None:
                i += 1
                continue
            yield UnitInfo(u.head, u.span, u.cls.slot_bytes, u.live, u.cls.per_unit)
            i += u.span

    def live(self, head: int) -> int:
        """Live slots of the unit whose first extent is `head` (0 if free)."""
        u = self._units[head]
        return 0 if u is None or u.head != head else u.live

    def has_class(self, size: int) -> bool:
        """True when the class of `size` holds at least one unit."""
        return self.slot_bytes(size) in self._classes

    def release_candidates(self, size: int, releasable: Callable[[int], bool],
                           partial_only: bool = False) -> Optional[list[int]]:
        """Heads of the units to empty so that `alloc(size)` can take a unit:
        the choice with the fewest live slots among units `releasable(head)`
        accepts (the owner's judgement: nothing leased or being written), or
        None. `partial_only`: only units of other classes that still have a
        free slot (space the owner's byte count believes free). A run class
        needs contiguous extents: the cheapest window of free extents and
        releasable units."""
        slot = self.slot_bytes(size)
        span = self.span_of(size)
        if span > self.extent_count:
            return None
        if span == 1:
            best: Optional[tuple[int, int]] = None
            for u in self.units():
                if partial_only and (u.slot_bytes == slot or u.live >= u.per_unit):
                    continue
                if (best is None or u.live < best[0]) and releasable(u.head):
                    best = (u.live, u.head)
            return None if best is None else [best[1]]
        if partial_only:
            return None
        best_run: Optional[tuple[int, list[int]]] = None
        for start in range(self.extent_count - span + 1):
            cost, heads, ok = 0, [], True
            for i in range(start, start + span):
                u = self._units[i]
                if u is None or (heads and heads[-1] == u.head):
                    continue
                if not releasable(u.head):
                    ok = False
                    break
                cost += u.live
                heads.append(u.head)
            if ok and (best_run is None or cost < best_run[0]):
                best_run = (cost, heads)
                if cost == 0:
                    break
        return None if best_run is None else best_run[1]

    # ---- internals ---------------------------------------------------------
    def _class(self, size: int) -> _Class:
        slot = self.slot_bytes(size)
        cls = self._classes.get(slot)
        if cls is None:
            span = self.span_of(size)
            cls = _Class(slot, span, max(1, (span * self.extent_bytes) // slot))
            self._classes[slot] = cls
        return cls

    def _take_unit(self, cls: _Class) -> Optional[_Unit]:
        if cls.span > self._free_extents:
            self._forget_if_empty(cls)
            return None
        head = self._pop_free() if cls.span == 1 else self._find_run(cls.span)
        if head is None:
            self._forget_if_empty(cls)
            return None
        unit = _Unit(head, cls.span, cls)
        for i in range(head, head + cls.span):
            self._units[i] = unit
        self._free_extents -= cls.span
        cls.units += 1
        cls.open[head] = None
        return unit

    def _forget_if_empty(self, cls: _Class) -> None:
        if cls.units == 0:
            self._classes.pop(cls.slot_bytes, None)

    def _pop_free(self) -> Optional[int]:
        heap = self._free_heap
        while heap:
            i = heapq.heappop(heap)
            self._in_heap[i] = False
            if self._units[i] is None:
                return i
        return None

    def _find_run(self, span: int) -> Optional[int]:
        run = 0
        for i in range(self.extent_count):
            run = run + 1 if self._units[i] is None else 0
            if run == span:
                return i - span + 1
        return None
