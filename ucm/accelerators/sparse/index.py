"""SummaryIndex: the block summaries of one process, by block key, in memory.

Where summaries live. In the memory of the process whose selection reads
them (the engine process for the transformers path), beside the cache and
outside its tiers: selecting needs only the summaries, never a block's KV,
so a block may sit in DRAM, on NVMe or in a cluster store while its summary
is here. The index is bounded (`capacity_bytes`); when it is full the
least recently used summaries are forgotten first, and a block without a
summary is simply one selection cannot score (the caller keeps it, or
reads and summarises it again).

Restart. Nothing is persisted: a summary is a function of the stored bytes
and the layout (ucm/accelerators/sparse/summaries.py), so after a restart it
is rebuilt from the block itself, by `add` when the block is read or
stored again. Its cost in memory is `summaries.summary_nbytes` per block.

Fed explicitly (`add(key, block_bytes, layout)` where the bytes are in
hand, `put(key, summary)`). No accelerator feeds it from `blocks_stored`
yet: that event carries no bytes and no layout, and reading a block back
through `read_slots` without the storing request's id would count as an
access to the placement policy. Thread-safe (one lock, held for dictionary
work only: summarising runs outside it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

from ucm.accelerators.sparse.lowrank import KeyBasis
from ucm.accelerators.sparse.summaries import BlockSummary, SummaryParts, summarize
from ucm.codecs.layout import KvLayout
from ucm.errors import ArgumentError


class SummaryIndex:
    """Block summaries by key, least recently used forgotten first."""

    def __init__(self, capacity_bytes: int, page_tokens: int = 16, parts: SummaryParts = SummaryParts()) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ArgumentError(f"SummaryIndex: capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.page_tokens = page_tokens
        self.parts = parts  # the page summaries `add` keeps
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, BlockSummary] = OrderedDict()
        self._used = 0
        self._counts = {"summaries_added": 0, "summaries_evicted": 0, "summaries_refused": 0,
                        "lookups": 0, "lookup_misses": 0}

    def add(self, key: bytes, block: object, layout: KvLayout,
            basis: Optional[KeyBasis] = None) -> Optional[BlockSummary]:
        """Summarises `block` (its bytes under `layout`, this index's parts
        at its page size, projected on `basis` when given) and keeps it under
        `key`; the summary, or None when it alone is larger than the index
        (counted `summaries_refused`)."""
        return self.put(key, summarize(block, layout, self.page_tokens, basis, self.parts))

    def put(self, key: bytes, summary: BlockSummary) -> Optional[BlockSummary]:
        """Keeps `summary` under `key` (replacing one kept before)."""
        if not isinstance(summary, BlockSummary):
            raise ArgumentError(f"SummaryIndex.put: expected a BlockSummary, got {type(summary).__name__}")
        if summary.page_tokens != self.page_tokens:
            raise ArgumentError(f"SummaryIndex.put: summary of {summary.page_tokens}-token pages, the index keeps "
                                f"{self.page_tokens}-token pages")
        size = summary.nbytes
        with self._lock:
            self._drop(key)
            if size > self.capacity_bytes:
                self._counts["summaries_refused"] += 1
                return None
            while self._used + size > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._counts["summaries_evicted"] += 1
            self._entries[key] = summary
            self._used += size
            self._counts["summaries_added"] += 1
        return summary

    def get(self, key: bytes) -> Optional[BlockSummary]:
        """The summary kept under `key` (now the most recently used), or None."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[BlockSummary]]:
        out: list[Optional[BlockSummary]] = []
        with self._lock:
            for key in keys:
                got = self._entries.get(key)
                if got is not None:
                    self._entries.move_to_end(key)
                out.append(got)
            self._counts["lookups"] += len(keys)
            self._counts["lookup_misses"] += sum(1 for s in out if s is None)
        return out

    def peek(self, key: bytes) -> Optional[BlockSummary]:
        """The summary kept under `key`, or None, without counting a lookup
        or making it the most recently used (a producer checking what it
        must add, not a reader)."""
        with self._lock:
            return self._entries.get(key)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        got = self._entries.pop(key, None)
        if got is not None:
            self._used -= got.nbytes

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def counters(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out["summaries"] = len(self._entries)
            out["summary_bytes"] = self._used
        return out
