"""HeatTracker: per-block access statistics that placement policies read.

Runs inside the cache (or the trace replay) under its lock; never blocks.
The clock is logical: it advances once per request (`tick`), so decisions are
deterministic and independent of wall-clock speed. Per block it keeps a
decayed access frequency, the time of the last access, the raw count, the
block's parent in the prefix tree, the oracle's next use (trace replay
only) and three facts about the last access: whether it was the deepest
block of its request (the first access after a `tick`; the cache reports a
request's blocks deepest first), whether the block's parent had been seen
before it, and whether the request that last used the block generated a
long answer (`finish`, when the engine reports it).

Statistics outlive residency for a bounded number of blocks so that a block
that comes back is recognised as reused. The bound is in bytes
(`history_bytes`, config `heat.history_bytes`): each record costs about
`RECORD_BYTES` (measured with tracemalloc, 16-byte keys; see
tests/unit/policy/test_heat_tracker.py). Records are kept compact, one slot
per block in typed arrays indexed through one ordered dict (key -> slot),
least recently accessed forgotten first.

Listeners (`subscribe`) learn what happens to the records, in order:
`on_access(key, slot, now, first, ext)` before the record is updated (it
still shows the previous access), `on_tick(now)` after the clock advanced,
`on_forget(key, slot, now)` before a record is dropped, and
`on_reclass(key, slot, now, long_out)` before the output kind of a record
changes. They read records through the tracker and never write them (the
ReuseModel of the heat policy, ucm/placement/policies/reuse.py, is one).
"""
from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, TypeVar

from ucm.errors import ArgumentError

Key = bytes

INF = math.inf

# Output tokens from which a request's answer counts as long (`finish`).
LONG_OUTPUT = 128
# Flag bits of a record (`flags(slot)`).
TAIL = 1  # the last access was the deepest block of its request
EXT = 2  # at its last access its parent had been seen before
LONG_OUT = 4  # its last finished request generated >= LONG_OUTPUT tokens

# Bytes one record costs when the history is full (16-byte keys), measured
# with tracemalloc over 200k records: about 193 for the ordered-dict entry,
# its slot number, the arrays (49) and the parent reference (8), plus the
# key itself (49 bytes for 16-byte keys); rounded up.
RECORD_BYTES = 250
DEFAULT_HISTORY_BYTES = 256 << 20  # about a million records (1,073,741)


@dataclass(frozen=True, slots=True)
class BlockHeat:
    """A snapshot of one record (`HeatTracker.get`), for reading off the hot path."""

    score: float  # decayed frequency as of `stamp`
    stamp: int
    last: int  # clock of the last access, -1 never accessed
    count: int
    gaps: float  # decayed mean reuse distance (clock ticks), 0 until reused
    parent: Optional[Key]
    next_use: float  # oracle: next access time, set by trace replay only
    tail: bool
    ext: bool
    long_out: bool


class HeatListener(Protocol):
    """What a subscriber of a HeatTracker receives (see the module docstring)."""

    def on_access(self, key: Key, slot: int, now: int, first: bool, ext: bool) -> None: ...

    def on_tick(self, now: int) -> None: ...

    def on_forget(self, key: Key, slot: int, now: int) -> None: ...

    def on_reclass(self, key: Key, slot: int, now: int, long_out: bool) -> None: ...


L = TypeVar("L")


class HeatTracker:
    """Decayed frequency, recency and prefix links of blocks.

    `half_life` is in clock ticks (requests): a block's score halves every
    `half_life` requests without access. `history_bytes` bounds the records
    kept (`history_blocks`, if given, sets their number directly).
    """

    def __init__(self, half_life: float = 2000.0, history_bytes: int = DEFAULT_HISTORY_BYTES,
                 history_blocks: Optional[int] = None) -> None:
        if half_life <= 0:
            raise ArgumentError(f"half_life must be > 0, got {half_life!r}")
        if history_blocks is None:
            if history_bytes < RECORD_BYTES:
                raise ArgumentError(f"history_bytes must be >= {RECORD_BYTES} (one record), "
                                    f"got {history_bytes!r}")
            history_blocks = history_bytes // RECORD_BYTES
        if history_blocks < 1:
            raise ArgumentError(f"history_blocks must be >= 1, got {history_blocks!r}")
        self.now = 0
        self.half_life = float(half_life)
        self._lam = math.log(2.0) / self.half_life
        self.history_blocks = history_blocks
        self._slots: OrderedDict[Key, int] = OrderedDict()  # least recently accessed first
        self._free: list[int] = []
        # One entry per slot. Public for listeners and policies to read by
        # slot on the hot path; only the tracker writes them.
        self.score = array("d")
        self.stamp = array("q")
        self.last = array("q")
        self.count = array("q")
        self.gaps = array("d")
        self.next_uses = array("d")
        self.flags = array("B")
        self.parents: list[Optional[Key]] = []
        self._first = False  # the next touch is the first (deepest) of a request
        self._listeners: list[Any] = []

    # ---- listeners -----------------------------------------------------------
    def subscribe(self, listener: HeatListener) -> None:
        """`listener` receives every event from now on (once, however often
        it subscribes)."""
        if not any(x is listener for x in self._listeners):
            self._listeners.append(listener)

    def listener(self, cls: type[L]) -> Optional[L]:
        """The subscribed listener of type `cls`, if any (policies of one
        cache share one model this way)."""
        for x in self._listeners:
            if type(x) is cls:
                return x
        return None

    # ---- events ---------------------------------------------------------------
    def tick(self) -> int:
        """Advances the clock by one request; returns the new time."""
        self.now += 1
        self._first = True
        for x in self._listeners:
            x.on_tick(self.now)
        return self.now

    def _new(self, key: Key) -> int:
        slots = self._slots
        if len(slots) >= self.history_blocks:
            old, s = slots.popitem(last=False)
            for x in self._listeners:
                x.on_forget(old, s, self.now)
            self._free.append(s)
        if self._free:
            s = self._free.pop()
            self.score[s] = 0.0
            self.stamp[s] = self.now
            self.last[s] = -1
            self.count[s] = 0
            self.gaps[s] = 0.0
            self.next_uses[s] = INF
            self.flags[s] = 0
            self.parents[s] = None
        else:
            s = len(self.parents)
            self.score.append(0.0)
            self.stamp.append(self.now)
            self.last.append(-1)
            self.count.append(0)
            self.gaps.append(0.0)
            self.next_uses.append(INF)
            self.flags.append(0)
            self.parents.append(None)
        slots[key] = s
        return s

    def touch(self, key: Key, parent: Optional[Key] = None, next_use: float = INF) -> None:
        """Records one access to `key` at the current time."""
        slots = self._slots
        s = slots.get(key)
        if s is None:
            s = self._new(key)
        else:
            slots.move_to_end(key)
        now = self.now
        first, self._first = self._first, False
        ps = slots.get(parent) if parent is not None else None
        last = self.last
        ext = ps is not None and self.count[ps] > 0 and last[ps] < now
        flags = self.flags
        f = flags[s]
        prev = last[s]
        if prev < 0 and ps is not None:  # a new block: its parent's kind until its request reports
            f = (f & ~LONG_OUT) | (flags[ps] & LONG_OUT)
            flags[s] = f
        for x in self._listeners:
            x.on_access(key, s, now, first, ext)
        if prev >= 0:
            gap = float(now - prev)
            g = self.gaps[s]
            self.gaps[s] = gap if g == 0.0 else 0.5 * g + 0.5 * gap
        self.score[s] = self.score[s] * math.exp(-self._lam * (now - self.stamp[s])) + 1.0
        self.stamp[s] = now
        last[s] = now
        self.count[s] += 1
        if parent is not None:
            self.parents[s] = parent
        self.next_uses[s] = next_use
        flags[s] = (f & LONG_OUT) | (TAIL if first else 0) | (EXT if ext else 0)

    def touch_request(self, keys: Sequence[Key], parent: Optional[Key] = None,
                      next_uses: Optional[Sequence[float]] = None) -> None:
        """Records one access to each block of a request, deepest first:
        exactly `touch(keys[i], keys[i - 1], next_uses[i])` for i from
        `len(keys) - 1` down to 1, then `touch(keys[0], parent,
        next_uses[0])` (next use INF without `next_uses`), in one call."""
        if self._listeners:  # listeners see every step: the plain calls
            touch = self.touch
            for i in range(len(keys) - 1, 0, -1):
                touch(keys[i], keys[i - 1], INF if next_uses is None else next_uses[i])
            if keys:
                touch(keys[0], parent, INF if next_uses is None else next_uses[0])
            return
        slots = self._slots
        get, move, new = slots.get, slots.move_to_end, self._new
        now, lam, exp = self.now, self._lam, math.exp
        score, stamp, last, count, gaps = self.score, self.stamp, self.last, self.count, self.gaps
        nus, flags, parents = self.next_uses, self.flags, self.parents
        first = self._first
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            up = keys[i - 1] if i else parent
            s = get(key)
            if s is None and up != key and not self._free and len(slots) < self.history_blocks:
                # A new record in a new slot: its values written once (what
                # _new's defaults followed by the update below come to).
                ps = get(up) if up is not None else None
                ext = ps is not None and count[ps] > 0 and last[ps] < now
                slots[key] = len(parents)
                score.append(1.0)
                stamp.append(now)
                last.append(now)
                count.append(1)
                gaps.append(0.0)
                nus.append(INF if next_uses is None else next_uses[i])
                flags.append((flags[ps] & LONG_OUT if ps is not None else 0) | (TAIL if first else 0)
                             | (EXT if ext else 0))
                parents.append(up)
                first = False
                continue
            if s is None:
                s = new(key)
            else:
                move(key)
            ps = get(up) if up is not None else None
            ext = ps is not None and count[ps] > 0 and last[ps] < now
            f = flags[s]
            prev = last[s]
            if prev < 0 and ps is not None:
                f = (f & ~LONG_OUT) | (flags[ps] & LONG_OUT)
            if prev >= 0:
                gap = float(now - prev)
                g = gaps[s]
                gaps[s] = gap if g == 0.0 else 0.5 * g + 0.5 * gap
            score[s] = score[s] * exp(-lam * (now - stamp[s])) + 1.0
            stamp[s] = now
            last[s] = now
            count[s] += 1
            if up is not None:
                parents[s] = up
            nus[s] = INF if next_uses is None else next_uses[i]
            flags[s] = (f & LONG_OUT) | (TAIL if first else 0) | (EXT if ext else 0)
            first = False
        self._first = first

    def finish(self, keys: Iterable[Key], output_tokens: int) -> list[Key]:
        """The request that used `keys` finished after generating
        `output_tokens` tokens: its blocks take that output kind. Unknown
        keys are skipped. Returns the keys whose kind changed."""
        long_out = output_tokens >= LONG_OUTPUT
        want = LONG_OUT if long_out else 0
        slots, flags = self._slots, self.flags
        changed = []
        for key in keys:
            s = slots.get(key)
            if s is None or flags[s] & LONG_OUT == want:
                continue
            for x in self._listeners:
                x.on_reclass(key, s, self.now, long_out)
            flags[s] = (flags[s] & ~LONG_OUT) | want
            changed.append(key)
        return changed

    def link(self, key: Key, parent: Optional[Key]) -> None:
        """Records the prefix-tree parent of `key` without counting an access."""
        if parent is not None:
            s = self._slots.get(key)
            if s is None:
                s = self._new(key)
            else:
                self._slots.move_to_end(key)
            self.parents[s] = parent

    def forget(self, key: Key) -> None:
        s = self._slots.get(key)
        if s is None:
            return
        for x in self._listeners:
            x.on_forget(key, s, self.now)
        del self._slots[key]
        self._free.append(s)
        self.last[s] = -1
        self.parents[s] = None

    # ---- reads -----------------------------------------------------------------
    def slot(self, key: Key) -> Optional[int]:
        """The record slot of `key` (valid until the record is forgotten), or None."""
        return self._slots.get(key)

    def get(self, key: Key) -> Optional[BlockHeat]:
        s = self._slots.get(key)
        if s is None:
            return None
        f = self.flags[s]
        return BlockHeat(self.score[s], self.stamp[s], self.last[s], self.count[s], self.gaps[s],
                         self.parents[s], self.next_uses[s], bool(f & TAIL), bool(f & EXT),
                         bool(f & LONG_OUT))

    def heat(self, key: Key) -> float:
        """Decayed access frequency of `key` as of now (0.0 if unknown)."""
        s = self._slots.get(key)
        if s is None:
            return 0.0
        return self.score[s] * math.exp(-self._lam * (self.now - self.stamp[s]))

    def next_use(self, key: Key) -> float:
        s = self._slots.get(key)
        return INF if s is None else self.next_uses[s]

    def tail(self, key: Key) -> bool:
        """Whether the last access to `key` was the deepest block of its request."""
        s = self._slots.get(key)
        return s is not None and bool(self.flags[s] & TAIL)

    def parent(self, key: Key) -> Optional[Key]:
        s = self._slots.get(key)
        return None if s is None else self.parents[s]

    def __len__(self) -> int:
        return len(self._slots)
