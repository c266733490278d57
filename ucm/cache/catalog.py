"""The block catalog: what a cache tells the routers above the engines.

An engine's connector describes the blocks it stores (`describe`: each
block's key, its parent's key, its token ids and the request context the
engine hashes with). The catalog keeps those descriptions, finds the tier
each described block sits in (`sweep`, through the cache's `locate`, when
a reader asks: at most every `min_sweep_s`, and less often when the
catalog is large), and journals every change: a block that entered a
tier or moved to another (`stored`, with its description and the tier's
KV-event medium) and one that left every tier (`removed`). Readers page through the journal (`events`); one that is too
far behind, or that read another instance's journal (`epoch`), is told to
`reset` and reads the current holdings (`holdings`) before it goes on.

A described block that never shows up in a tier (its store failed) is
forgotten after `pending_s`; one that left every tier is forgotten when
the removal is journaled. At most `max_blocks` descriptions are kept (the
oldest goes, journaled as removed if it was held) and `journal` events.
The catalog learns nothing from the blocks' bytes and never claims a block
the cache's own `locate` does not find. Thread-safe.

With a `DescriptionLog` (`events.path`) the descriptions outlive the
process: they are appended to it as they come, read back when the catalog
starts (each then waits for a sweep to find its block, as a new
description does: a block a persistent tier kept is advertised again, one
that is gone is forgotten after `pending_s`), and the file is rewritten
from the catalog's descriptions once it holds more than twice as many.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict, deque
from typing import Callable, Mapping, Optional, Sequence

from ucm.api import Key
from ucm.cache.catalog_log import DescriptionLog

__all__ = ["BlockCatalog"]

SWEEP_BATCH = 4096
COMPACT_SLACK = 1024  # records the log may hold beyond twice the catalog's before it is rewritten


class _Entry:
    __slots__ = ("parent", "tokens", "extra", "tier", "since")

    def __init__(self, parent: Optional[Key], tokens: bytes, extra: Optional[dict], since: float) -> None:
        self.parent, self.tokens, self.extra = parent, tokens, extra
        self.tier: Optional[str] = None  # where the last sweep found it
        self.since = since  # when it was described (for a block not held yet)


class BlockCatalog:
    """Described blocks, where they are, and the journal of their changes."""

    def __init__(self, locate: Callable[[list[Key]], list[Optional[str]]], media: Mapping[str, str], *,
                 max_blocks: int = 1 << 16, journal: int = 1 << 16, min_sweep_s: float = 0.05,
                 sweep_share: float = 0.05, pending_s: float = 60.0,
                 log: Optional[DescriptionLog] = None) -> None:
        """`locate`: the cache's fastest tier per key (None: no tier);
        `media`: each tier's KV-event medium (a tier missing from it is not
        advertised); `log`: where descriptions are kept across restarts
        (read here, appended to by `describe`)."""
        self._locate = locate
        self.media = dict(media)
        self.max_blocks = max_blocks
        self.min_sweep_s = min_sweep_s
        self.sweep_share = sweep_share  # of a core, at most, that sweeps take
        self.pending_s = pending_s
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1  # this instance's journal
        self._lock = threading.Lock()
        self._sweeping = threading.Lock()
        self._blocks: OrderedDict[Key, _Entry] = OrderedDict()
        self._journal: deque = deque(maxlen=journal)  # (seq, kind, key, tier, entry)
        self._seq = 0  # the seq of the last event journaled
        self._next_sweep = 0.0  # monotonic time before which no sweep runs unforced
        self.counts = {"described": 0, "stored": 0, "removed": 0, "forgotten": 0, "sweeps": 0, "restored": 0}
        self._log_file = log
        if log is not None:
            self._add(log.load(), "restored")

    # ---- writers -----------------------------------------------------------------
    def describe(self, blocks: Sequence[tuple[Key, Optional[Key], bytes, Optional[dict]]]) -> None:
        """Descriptions of blocks an engine stores (`ucm.api.check_blocks`'
        shape; already checked). A key described before keeps its description."""
        new = self._add(blocks, "described")
        if self._log_file is not None:
            self._log_file.append(new)

    def _add(self, blocks, count: str) -> list:
        """Adds the blocks not described yet, counted as `count`; returns them."""
        now = time.monotonic()
        new = []
        with self._lock:
            for b in blocks:
                key, parent, tokens, extra = b
                if key in self._blocks:
                    continue
                new.append(b)
                self._blocks[key] = _Entry(parent, tokens, extra, now)
                self.counts[count] += 1
                while len(self._blocks) > self.max_blocks:
                    old, e = self._blocks.popitem(last=False)
                    self.counts["forgotten"] += 1
                    if e.tier is not None:
                        self._log("removed", old, e.tier, e)
        return new

    def _log(self, kind: str, key: Key, tier: Optional[str], e: _Entry) -> None:
        self._seq += 1
        self._journal.append((self._seq, kind, key, tier, e))
        self.counts[kind] += 1

    def sweep(self, force: bool = False) -> None:
        """Finds every described block's tier and journals the changes. At
        most one sweep at a time and, unless forced, none before
        `min_sweep_s` after the last, nor so soon that sweeps take more
        than `sweep_share` of a core: a sweep costs a locate per described
        block, however many readers ask."""
        if not force and time.monotonic() < self._next_sweep:
            return
        with self._sweeping:
            if not force and time.monotonic() < self._next_sweep:
                return
            t0 = time.monotonic()
            with self._lock:
                keys = list(self._blocks)
            for i in range(0, len(keys), SWEEP_BATCH):
                part = keys[i:i + SWEEP_BATCH]
                tiers = list(self._locate(part))
                now = time.monotonic()
                with self._lock:
                    for key, tier in zip(part, tiers):
                        e = self._blocks.get(key)
                        if e is None:
                            continue
                        if tier is not None and tier not in self.media:
                            tier = None  # a tier routers are not told of
                        if tier == e.tier:
                            if tier is None and now - e.since > self.pending_s:
                                del self._blocks[key]  # its store never landed
                                self.counts["forgotten"] += 1
                            continue
                        if tier is None:
                            self._log("removed", key, e.tier, e)
                            del self._blocks[key]
                        else:
                            e.tier = tier
                            self._log("stored", key, tier, e)
            done = time.monotonic()
            self._next_sweep = done + max(self.min_sweep_s, (done - t0) * (1 / self.sweep_share - 1))
            self.counts["sweeps"] += 1
            lf = self._log_file
            if lf is not None and lf.records > 2 * len(self._blocks) + COMPACT_SLACK:
                lf.rewrite(self._descriptions)

    def close(self) -> None:
        """Closes the log (the catalog goes on in memory)."""
        if self._log_file is not None:
            self._log_file.close()

    def _descriptions(self) -> list:
        with self._lock:
            return [(k, e.parent, e.tokens, e.extra) for k, e in self._blocks.items()]

    # ---- readers -----------------------------------------------------------------
    def _row(self, seq: int, kind: str, key: Key, tier: Optional[str], e: _Entry) -> list:
        medium = self.media.get(tier) if tier is not None else None
        if kind == "removed":
            return [seq, kind, key, medium, None, None, None]
        return [seq, kind, key, medium, e.parent, e.tokens, e.extra]

    def events(self, since: int, epoch: Optional[int], limit: int = 256) -> dict:
        """The journal after `since` (at most `limit` events), for a reader
        of `epoch`: {"epoch", "next", "events", "reset"}. Each event is
        [seq, kind, key, medium, parent, tokens, extra] (the last three
        None for a removal). `reset` is true, with no events, when the
        reader must start over from `holdings` and then read from `next`."""
        self.sweep()
        with self._lock:
            oldest = self._journal[0][0] if self._journal else self._seq + 1
            if epoch != self.epoch or since > self._seq or since < oldest - 1:
                return {"epoch": self.epoch, "next": self._seq, "events": [], "reset": True}
            rows = [self._row(*ev) for ev in self._journal if ev[0] > since][:limit]
            nxt = rows[-1][0] if rows else since
            return {"epoch": self.epoch, "next": nxt, "events": rows, "reset": False}

    def holdings(self, offset: int, limit: int = 256) -> dict:
        """The held described blocks from position `offset` of the catalog
        (parents before children), as `stored` events with seq 0:
        {"blocks", "next_offset", "done"}."""
        with self._lock:
            held = [(k, e) for k, e in self._blocks.items() if e.tier is not None]
            part = held[offset:offset + limit]
            rows = [self._row(0, "stored", k, e.tier, e) for k, e in part]
            end = offset + len(part)
            return {"blocks": rows, "next_offset": end, "done": end >= len(held)}

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._blocks), "held": sum(1 for e in self._blocks.values() if e.tier),
                    "seq": self._seq, **self.counts,
                    "logged": self._log_file.records if self._log_file is not None and self._log_file.active
                    else None}
