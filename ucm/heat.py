"""HeatTracker: per-block access statistics that placement policies read.

Runs inside the cache (or the trace replay) under its lock; never blocks.
The clock is logical: it advances once per request (`tick`), so decisions are
deterministic and independent of wall-clock speed. Per block it keeps a
decayed access frequency, the time of the last access, the raw count, and
the block's parent in the prefix tree, and whether that access was the
deepest block of its request (the first access after a `tick`; the cache
reports a request's blocks deepest first), whether its parent had been
seen before that access, and whether the request that last used it
generated a long answer (`finish`, when the engine reports it).
Statistics outlive residency for a bounded number of blocks
(`history_blocks`) so that a block that comes back is recognised as
reused. On request (`reuse_model()`), it also feeds a
ReuseModel (ucm/reuse.py) that learns reuse hazards from every access.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from ucm.errors import ArgumentError
from ucm.reuse import LONG_OUTPUT, ReuseModel

Key = bytes

INF = math.inf


@dataclass(slots=True)
class BlockHeat:
    score: float = 0.0  # decayed frequency as of `stamp`
    stamp: int = 0
    last: int = -1  # clock of the last access, -1 never accessed
    count: int = 0
    gaps: float = 0.0  # decayed mean reuse distance (clock ticks), 0 until reused
    parent: Optional[Key] = None
    next_use: float = INF  # oracle: next access time, set by trace replay only
    tail: bool = False  # the last access was the deepest block of its request
    ext: bool = False  # at its last access its parent had been seen before
    long_out: bool = False  # its last finished request generated >= LONG_OUTPUT tokens


class HeatTracker:
    """Decayed frequency, recency and prefix links of blocks.

    `half_life` is in clock ticks (requests): a block's score halves every
    `half_life` requests without access.
    """

    def __init__(self, half_life: float = 2000.0, history_blocks: int = 1 << 20) -> None:
        if half_life <= 0:
            raise ArgumentError(f"half_life must be > 0, got {half_life!r}")
        self.now = 0
        self.half_life = float(half_life)
        self._lam = math.log(2.0) / self.half_life
        self._history = history_blocks
        self._blocks: OrderedDict[Key, BlockHeat] = OrderedDict()
        self._first = False  # the next touch is the first (deepest) of a request
        self._reuse: Optional[ReuseModel] = None

    def tick(self) -> int:
        """Advances the clock by one request; returns the new time."""
        self.now += 1
        self._first = True
        if self._reuse is not None:
            self._reuse.advance(self.now)
        return self.now

    def reuse_model(self) -> ReuseModel:
        """The ReuseModel fed by this tracker, created (and fed from then on)
        at the first call; every policy of a cache shares it."""
        if self._reuse is None:
            self._reuse = ReuseModel()
        return self._reuse

    def _get(self, key: Key) -> BlockHeat:
        h = self._blocks.get(key)
        if h is None:
            h = BlockHeat(stamp=self.now)
            self._blocks[key] = h
            if len(self._blocks) > self._history:
                _, old = self._blocks.popitem(last=False)
                if self._reuse is not None:
                    self._reuse.forget(old, self.now)
        else:
            self._blocks.move_to_end(key)
        return h

    def touch(self, key: Key, parent: Optional[Key] = None, next_use: float = INF) -> None:
        """Records one access to `key` at the current time."""
        h = self._get(key)
        now = self.now
        first, self._first = self._first, False
        ph = self._blocks.get(parent) if parent is not None else None
        ext = ph is not None and ph.count > 0 and ph.last < now
        if h.last < 0 and ph is not None:
            h.long_out = ph.long_out  # a new block: its parent's kind until its request reports
        if self._reuse is not None:
            self._reuse.access(h, now, first, ext)
        if h.last >= 0:
            gap = float(now - h.last)
            h.gaps = gap if h.gaps == 0.0 else 0.5 * h.gaps + 0.5 * gap
        h.score = h.score * math.exp(-self._lam * (now - h.stamp)) + 1.0
        h.stamp = now
        h.last = now
        h.count += 1
        if parent is not None:
            h.parent = parent
        h.next_use = next_use
        h.tail = first
        h.ext = ext

    def finish(self, keys: Iterable[Key], output_tokens: int) -> list[Key]:
        """The request that used `keys` finished after generating
        `output_tokens` tokens: its blocks take that output kind (a feature
        of the ReuseModel's classes). Unknown keys are skipped. Returns the
        keys whose kind changed."""
        long_out = output_tokens >= LONG_OUTPUT
        reuse = self._reuse
        changed = []
        for key in keys:
            h = self._blocks.get(key)
            if h is None or h.long_out == long_out:
                continue
            if reuse is not None:
                reuse.reclass(h, self.now, long_out)
            else:
                h.long_out = long_out
            changed.append(key)
        return changed

    def link(self, key: Key, parent: Optional[Key]) -> None:
        """Records the prefix-tree parent of `key` without counting an access."""
        if parent is not None:
            self._get(key).parent = parent

    def heat(self, key: Key) -> float:
        """Decayed access frequency of `key` as of now (0.0 if unknown)."""
        h = self._blocks.get(key)
        if h is None:
            return 0.0
        return h.score * math.exp(-self._lam * (self.now - h.stamp))

    def get(self, key: Key) -> Optional[BlockHeat]:
        return self._blocks.get(key)

    def count(self, key: Key) -> int:
        h = self._blocks.get(key)
        return 0 if h is None else h.count

    def last_access(self, key: Key) -> int:
        h = self._blocks.get(key)
        return -1 if h is None else h.last

    def next_use(self, key: Key) -> float:
        h = self._blocks.get(key)
        return INF if h is None else h.next_use

    def tail(self, key: Key) -> bool:
        """Whether the last access to `key` was the deepest block of its request."""
        h = self._blocks.get(key)
        return False if h is None else h.tail

    def parent(self, key: Key) -> Optional[Key]:
        h = self._blocks.get(key)
        return None if h is None else h.parent

    def forget(self, key: Key) -> None:
        h = self._blocks.pop(key, None)
        if h is not None and self._reuse is not None:
            self._reuse.forget(h, self.now)

    def __len__(self) -> int:
        return len(self._blocks)
