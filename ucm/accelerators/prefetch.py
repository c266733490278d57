"""Prefetch, staging on first sight: when a request is first seen (the
scheduler's lookup, `begin_request`), the blocks of its cached prefix that
this node's cache holds only below the landing tier are staged up into it in
the background
(`CacheAPI.prefetch`), so that by the time the engine reads them (a
request waiting for pages, or queued behind others) they are in DRAM.

It never delays the call that fired it: the staging is one asynchronous
`prefetch` per request, and one that would take more than
`max_inflight_blocks` blocks in flight is skipped (counted). A staging that
fails or comes too late costs nothing but the bytes read: the engine's load
then stages or misses as it would have without prefetch.

Counters:
- `requests_staged`, `blocks_issued`, `bytes_issued`: staging issued;
- `blocks_staged`: blocks that reached the landing tier;
- `blocks_used`: staged blocks later read from the landing tier;
- `blocks_wasted`, `bytes_wasted`: staged blocks their request finished
  without reading from the landing tier;
- `blocks_failed`: blocks whose staging failed (not room, not admitted, a
  bad copy below);
- `requests_skipped`: requests not staged (too many blocks in flight);
- `requests_over_budget`: requests not staged because their blocks would
  pass `max_staged_bytes` of staged blocks not yet read (by default half
  the landing tier: stagings then never evict each other's unused blocks);
- `staging_s`: seconds of staging, summed over requests (issue to done).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Optional

from pydantic import Field

from ucm.accelerators.base import (Accelerator, AcceleratorOptions, BlocksLoaded, RequestFinished,
                                   RequestSeen)
from ucm.api import Handle, Outcome


class PrefetchOptions(AcceleratorOptions):
    # Blocks being staged at once, all requests together; a request whose
    # staging would pass it is not staged.
    max_inflight_blocks: int = Field(default=4096, ge=1)
    # Staged blocks remembered for `blocks_used` / `blocks_wasted` (oldest forgotten first).
    track_blocks: int = Field(default=1 << 16, ge=1)
    # Bytes of staged blocks not yet read (or still being staged), all
    # requests together; None: half of the landing tier's capacity.
    max_staged_bytes: Optional[int] = Field(default=None, ge=1)
    # A landed block not read this many seconds after its staging was issued
    # leaves the budget (counted wasted): a request that never finishes (an
    # engine that died on a shared service) cannot hold the budget forever.
    stale_after_s: float = Field(default=120.0, gt=0)


class PrefetchAccelerator(Accelerator):
    """Staging on first sight (module docstring); runs with the cache."""

    name = "prefetch"
    Config = PrefetchOptions

    def __init__(self, cache: Any, config: Any, **options: Any) -> None:
        super().__init__(cache, config, **options)
        names = [t.adapter for t in config.tiers]
        landing = names.index(config.landing_tier)
        self._landing = config.landing_tier
        self._below = frozenset(names[landing + 1:])
        self._budget = self.options.max_staged_bytes or config.tiers[landing].capacity // 2
        self._unused = 0  # bytes of the blocks in _staged
        self._lock = threading.Lock()
        self._inflight = 0
        # staged key -> [request id (None once it finished), bytes, reached the
        # landing tier, when issued (monotonic)]: staged for a request that has
        # not read it yet; oldest first
        self._staged: OrderedDict[bytes, list] = OrderedDict()
        self._counts = {k: 0 for k in ("requests_staged", "blocks_issued", "bytes_issued", "blocks_staged",
                                       "blocks_used", "blocks_wasted", "bytes_wasted", "blocks_failed",
                                       "requests_skipped", "requests_over_budget")}
        self._staging_s = 0.0

    def request_seen(self, event: RequestSeen) -> None:
        if not self._below or not event.keys:
            return
        below, sizes = [], []
        for key, tier, size in zip(event.keys, event.tiers, event.sizes):
            if tier is None:
                break  # the hit ends here: what follows cannot be used
            if tier in self._below:
                below.append(key)
                sizes.append(size)
        if not below:
            return
        with self._lock:
            self._expire(time.monotonic())
            if self._inflight + len(below) > self.options.max_inflight_blocks:
                self._counts["requests_skipped"] += 1
                return
            if self._unused + sum(sizes) > self._budget:
                self._counts["requests_over_budget"] += 1
                return
            self._inflight += len(below)
            self._counts["requests_staged"] += 1
            self._counts["blocks_issued"] += len(below)
            self._counts["bytes_issued"] += sum(sizes)
            for key, size in zip(below, sizes):
                self._track(key, event.request_id, size)
        start = time.monotonic()
        try:
            handle = self.cache.prefetch(below)
        except BaseException:  # a closing cache: nothing was issued
            with self._lock:
                self._inflight -= len(below)
                self._counts["requests_staged"] -= 1
                self._counts["blocks_issued"] -= len(below)
                self._counts["bytes_issued"] -= sum(sizes)
                for key in below:
                    entry = self._staged.get(key)
                    if entry is not None and entry[0] == event.request_id:
                        self._forget(key)
            raise
        handle.add_done_callback(lambda h: self._staged_done(below, h, start))

    def _track(self, key: bytes, request_id: str, size: int) -> None:
        staged = self._staged
        self._forget(key)
        staged[key] = [request_id, size, False, time.monotonic()]
        self._unused += size
        while len(staged) > self.options.track_blocks:
            self._forget(next(iter(staged)))

    def _expire(self, now: float) -> None:
        """Forgets landed blocks older than stale_after_s (under _lock);
        blocks still being staged wait for their outcome."""
        limit = now - self.options.stale_after_s
        staged = self._staged
        old = []
        for key, e in staged.items():  # oldest first: stops at the first young one
            if e[3] >= limit:
                break
            if e[2]:
                old.append(key)
        for key in old:
            entry = self._forget(key)
            self._counts["blocks_wasted"] += 1
            self._counts["bytes_wasted"] += entry[1]

    def _forget(self, key: bytes) -> list | None:
        """Drops a staged block from the books (under _lock); its entry."""
        entry = self._staged.pop(key, None)
        if entry is not None:
            self._unused -= entry[1]
        return entry

    def _staged_done(self, keys: list[bytes], handle: Handle, start: float) -> None:
        results = handle.results
        with self._lock:
            self._inflight -= len(keys)
            self._staging_s += time.monotonic() - start
            for key, outcome in zip(keys, results):
                entry = self._staged.get(key)
                if outcome is Outcome.DONE:
                    self._counts["blocks_staged"] += 1
                    if entry is not None and entry[0] is None:  # its request finished meanwhile
                        self._forget(key)
                        self._counts["blocks_wasted"] += 1
                        self._counts["bytes_wasted"] += entry[1]
                    elif entry is not None:
                        entry[2] = True
                else:
                    self._counts["blocks_failed"] += 1
                    if entry is not None and not entry[2]:
                        self._forget(key)

    def blocks_loaded(self, event: BlocksLoaded) -> None:
        with self._lock:
            staged = self._staged
            for key, outcome, tier in zip(event.keys, event.outcomes, event.tiers):
                if outcome is Outcome.DONE and tier == self._landing and key in staged:
                    entry = self._forget(key)
                    if entry[2]:
                        self._counts["blocks_used"] += 1

    def request_finished(self, event: RequestFinished) -> None:
        if event.request_id is None:
            return
        with self._lock:
            staged = self._staged
            for key in event.keys:
                entry = staged.get(key)
                if entry is None or entry[0] != event.request_id:
                    continue
                if entry[2]:
                    self._forget(key)
                    self._counts["blocks_wasted"] += 1
                    self._counts["bytes_wasted"] += entry[1]
                else:
                    entry[0] = None  # still being staged: wasted once it arrives

    def counters(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out["blocks_inflight"] = self._inflight
            out["staging_s"] = round(self._staging_s, 6)
        return out


Prefetch = PrefetchAccelerator  # the name before accelerators ended in their role
