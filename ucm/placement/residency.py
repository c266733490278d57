"""Residency: which tiers of the Python placement engine hold each block.

Per tier, a `TierLedger`: its resident blocks with their sizes, the bytes
they use, the count of resident children per resident parent (a parent
with a child in a tier is not that tier's victim while the child stays),
its counters, and its policy, which hears of every block that enters or
leaves (`on_insert`, `on_remove`). Across tiers, `Residency` keeps one bit
mask per resident key (bit t: tier t holds it), so that the fastest tier
holding a block, or whether another tier holds it, is one lookup.

The prefix tree (ucm/placement/tree.py) says who a block's parent and
children are; the engine (ucm/placement/engine.py) decides what enters and
leaves which tier. This module keeps the books in step, nothing more.

Not thread-safe: the engine's owner serialises calls.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from ucm.placement.heat import Key
from ucm.placement.plans import TierCounters
from ucm.placement.policies.base import PlacementPolicy, TierInfo
from ucm.placement.tree import PrefixTree

__all__ = ["Residency", "TierLedger"]


class TierLedger:
    """What one tier holds. Read its fields; change them through
    `Residency.enter` and `Residency.leave` (the counters excepted: the
    engine counts hits, evictions, promotions and demotions in them)."""

    __slots__ = ("info", "policy", "used", "blocks", "kids", "counters", "bit")

    def __init__(self, info: TierInfo, policy: PlacementPolicy) -> None:
        self.info = info
        self.policy = policy
        self.used = 0
        self.blocks: dict[Key, int] = {}  # key -> size_bytes
        self.kids: dict[Key, int] = {}  # key -> resident children in this tier (> 0)
        self.counters = TierCounters()
        self.bit = 1 << info.index  # its bit in a residency mask

    def enter(self, key: Key, size: int, children: Iterable[Key], parent: Optional[Key]) -> None:
        """`key` (`size` bytes, with cached `children`, behind `parent`)
        is now resident here."""
        blocks = self.blocks
        blocks[key] = size
        self.used += size
        c = self.counters
        c.inserts += 1
        c.bytes_written += size
        n = sum(1 for k in children if k in blocks)
        if n:
            self.kids[key] = n
        if parent is not None and parent in blocks:
            self.kids[parent] = self.kids.get(parent, 0) + 1
        self.policy.on_insert(key, size)

    def leave(self, key: Key, parent: Optional[Key]) -> None:
        """`key`, resident here, behind `parent`, is no longer."""
        blocks = self.blocks
        self.used -= blocks.pop(key)
        kids = self.kids
        kids.pop(key, None)
        if parent is not None and parent in blocks:
            left = kids[parent] - 1
            if left > 0:
                kids[parent] = left
            else:
                del kids[parent]
        self.policy.on_remove(key)


class Residency:
    """The tiers holding each resident key, over one ledger per tier."""

    def __init__(self, tiers: Sequence[TierLedger], tree: PrefixTree) -> None:
        """`tiers[t]` is tier t's ledger; `tree` gives parents and children."""
        self._tiers = list(tiers)
        self._tree = tree
        self._mask: dict[Key, int] = {}  # resident key -> bit mask of the tiers holding it

    def mask(self, key: Key) -> int:
        """The bit mask of the tiers holding `key` (0: none)."""
        return self._mask.get(key, 0)

    def where(self, key: Key) -> Optional[int]:
        """Fastest tier holding `key`, or None."""
        m = self._mask.get(key)
        if not m:
            return None
        return (m & -m).bit_length() - 1

    def locate(self, keys: Sequence[Key]) -> list[Optional[int]]:
        """`where` of each key."""
        masks = self._mask
        out: list[Optional[int]] = []
        for k in keys:
            m = masks.get(k)
            out.append((m & -m).bit_length() - 1 if m else None)
        return out

    def tiers_of(self, key: Key) -> list[int]:
        """Every tier holding `key`, fastest first."""
        m = self._mask.get(key, 0)
        return [t for t in range(len(self._tiers)) if m >> t & 1]

    def enter(self, key: Key, t: int, size: int) -> None:
        """`key`, cached in the tree, now resident in tier t too."""
        tier = self._tiers[t]
        masks = self._mask
        masks[key] = masks.get(key, 0) | tier.bit
        tree = self._tree
        tier.enter(key, size, tree.children_of(key), tree.parent_of(key))

    def leave(self, key: Key, t: int) -> None:
        """`key` is no longer resident in tier t (it may be elsewhere)."""
        tier = self._tiers[t]
        masks = self._mask
        m = masks[key] & ~tier.bit
        if m:
            masks[key] = m
        else:
            del masks[key]
        tier.leave(key, self._tree.parent_of(key))
