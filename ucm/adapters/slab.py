"""Slot allocation for fixed-size payloads inside one linear arena.

Slots are rounded up to `align` bytes and grouped in classes by their rounded
size; a freed slot returns to its class. Space is carved from the arena's end
on demand and never moves between classes, which suits KV blocks (one size
per namespace). Not thread-safe: the owning adapter holds its lock.
"""
from __future__ import annotations

from typing import Optional

from ucm.errors import ArgumentError


class SlabArena:
    def __init__(self, capacity_bytes: int, align: int = 4096) -> None:
        if capacity_bytes < 0:
            raise ArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if align <= 0 or align & (align - 1):
            raise ArgumentError(f"align must be a power of two, got {align}")
        self.capacity_bytes = capacity_bytes
        self.align = align
        self._bump = 0
        self._free: dict[int, list[int]] = {}
        self.used_bytes = 0

    def slot_bytes(self, size: int) -> int:
        return max(self.align, (size + self.align - 1) & ~(self.align - 1))

    def alloc(self, size: int) -> Optional[int]:
        """Offset of a slot of at least `size` bytes, or None if full."""
        if size <= 0:
            raise ArgumentError(f"slot size must be > 0, got {size}")
        slot = self.slot_bytes(size)
        free = self._free.get(slot)
        if free:
            off = free.pop()
        elif self._bump + slot <= self.capacity_bytes:
            off = self._bump
            self._bump += slot
        else:
            return None
        self.used_bytes += slot
        return off

    def free(self, offset: int, size: int) -> None:
        slot = self.slot_bytes(size)
        self._free.setdefault(slot, []).append(offset)
        self.used_bytes -= slot
