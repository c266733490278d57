"""WriteThrough: a copy of every block stored on this node, put at once into
the cluster tiers configured `write_through` (tiers other nodes read:
mooncake, redis), so another node finds it without waiting for a demotion
(the decode node of P/D across nodes, docs/connectors/vllm.md).

Stores and committed slot writes hand their keys to `submit` (never
blocking: past MAX_PENDING keys waiting, new ones are counted as dropped).
One background thread takes them in batches: the blocks still in the
landing tier are held there (placement) and put into each write-through
tier through that tier's adapter (its codec included) straight from their
shared-memory slots, leased meanwhile so that their bytes neither change
nor move (a landing tier without slots: copied out first). The copy is
the cluster's: this node's placement keeps the block where it was, and a
later demotion of it writes the same bytes under the same key (a put of a
key already there leaves it as it is). A failed read or put is counted,
never raised: the other node then misses and computes.

Acts on the cache's core (ucm/cache/core.py); its queue is its own state.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Sequence

from ucm.adapters.base import Status, StorageAdapter
from ucm.api import Key
from ucm.cache.core import CacheCore
from ucm.tiers.stack import has_slots

log = logging.getLogger(__name__)

BATCH = 64  # blocks read and put per round
MAX_PENDING = 1 << 16  # keys waiting for their copy; more are dropped (counted)


class WriteThrough:
    """See the module docstring. `tiers`: the indexes of the write-through tiers."""

    def __init__(self, core: CacheCore, tiers: Sequence[int]) -> None:
        self._core = core
        self._tiers = list(tiers)
        self._pending: deque[Key] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ucm-write-through", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[Key]) -> None:
        """Blocks just stored in the landing tier: copied in the background."""
        if not keys or self._closed:
            return
        with self._lock:
            room = MAX_PENDING - len(self._pending)
            self._pending.extend(keys[:max(0, room)])
            if room > 0:
                self._idle.clear()
        if len(keys) > room:
            self._core.counters.add("write_through_dropped", len(keys) - max(0, room))
        self._wake.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every block submitted so far was copied (or failed)."""
        return self._idle.wait(timeout_s)

    def _take(self) -> list[Key]:
        with self._lock:
            batch = [self._pending.popleft() for _ in range(min(BATCH, len(self._pending)))]
            if not batch:
                self._idle.set()
            return batch

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                batch = self._take()
                if not batch:
                    break
                try:
                    self._copy(batch)
                except Exception:  # never kills the thread: the blocks are counted as failed
                    log.exception("write-through of %d blocks failed", len(batch))
                    self._core.counters.add("write_through_failed", len(batch))

    def _copy(self, keys: list[Key]) -> None:
        core = self._core
        src = core.adapters[core.landing]
        with core.meta:
            here = [k for k in dict.fromkeys(keys) if core.placement.where(k) == core.landing]
            core.placement.hold(here)
        leases: list = []
        try:
            if has_slots(src):  # put straight out of the shared-memory slots, leased meanwhile
                leases = [src.lease(k) for k in here]
                blocks = [(held.key, held.view) for held in leases if held is not None]
            else:
                blocks = self._read(src, here)
            copied, failed = self._put(blocks)
        finally:
            for held in leases:
                if held is not None:
                    src.release(held)
            with core.meta:
                core.placement.unhold(here)
        failed += len(here) - len(blocks)  # unreadable there
        gone = len(set(keys)) - len(here)  # left the landing tier before their turn (demoted or dropped)
        core.counters.add("write_through_blocks", copied)
        if failed:
            core.counters.add("write_through_failed", failed)
        if gone:
            core.counters.add("write_through_gone", gone)

    @staticmethod
    def _read(src: StorageAdapter, keys: list[Key]) -> list[tuple[Key, bytearray]]:
        """The blocks of a landing tier without slots, copied out."""
        sizes = [src.size_of(k) for k in keys]
        keys = [k for k, n in zip(keys, sizes) if n]
        bufs = [bytearray(n) for n in sizes if n]
        read = src.get(keys, bufs) if keys else []
        return [(k, b) for k, b, st in zip(keys, bufs, read) if st is Status.OK]

    def _put(self, blocks: list[tuple[Key, Any]]) -> tuple[int, int]:
        """`blocks` put into every write-through tier: (copies made, copies failed)."""
        keys, bufs = [k for k, _ in blocks], [b for _, b in blocks]
        copied = failed = 0
        for t in self._tiers:
            try:
                statuses = self._core.adapters[t].put(keys, bufs) if keys else []
            except Exception:
                log.warning("write-through to %s failed", self._core.tier_names[t], exc_info=True)
                statuses = [Status.FAILED] * len(keys)
            done = sum(st is Status.OK for st in statuses)
            copied += done
            failed += len(keys) - done
        return copied, failed

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
