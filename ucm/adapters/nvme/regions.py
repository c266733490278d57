"""The nvme region table's records, and which region to reclaim.

`Loc` is where the current copy of a block is (the index maps key -> Loc);
`Region` is what the adapter knows of one region of the medium. Both are
plain records guarded by the adapter's lock; `choose_victim` is a pure
function of them (called with that lock held).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Optional, Sequence

Key = bytes


@dataclass(slots=True)
class Loc:
    """Where a block is, and what verifies it (as its footer entry records
    it, `ucm.adapters.nvme.format`): `chunk_bytes` and the chunk table
    `chunks` for a version-3 entry, `chunk_bytes` 0 for a version-2 one."""

    region: int
    offset: int
    length: int
    checksum: int
    parent: Optional[Key] = None
    chunk_bytes: int = 0
    chunks: bytes = b""


@dataclass(slots=True)
class Region:
    seq: int = 0
    live_bytes: int = 0
    live: set = field(default_factory=set)  # keys whose current copy is here
    has_footer: bool = False  # a valid trailer may be on the medium
    reclaiming: bool = False  # its live blocks are being read back (no lock held); not a victim again


def choose_victim(regions: Sequence[Region], in_memory: Container[int]) -> Optional[int]:
    """The region to reclaim: of those neither held by a write buffer nor
    being reclaimed, the one with the fewest live bytes, the oldest (lowest
    sequence number) on ties; None if there is none."""
    candidates = [r for r in range(len(regions)) if r not in in_memory and not regions[r].reclaiming]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (regions[r].live_bytes, regions[r].seq))
