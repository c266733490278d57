"""The cache's range reads: byte ranges of blocks, read where they are.

`read_ranges` (ucm.api.CacheAPI) serves a reader that needs a few spans of
a block, not the block: sparse decode reads one layer's K and V of the
pages its selector picked. A block in the landing tier is leased (shared
slots) or read (`get_range` where the adapter has it) and only the ranges
are copied out. A block held only below the landing tier is read range by
range from that tier, with `ucm.adapters.base.read_range`: an adapter that
declares RangeReads (nvme: the chunks covering each range, each verified;
fs) reads only those bytes from its medium; the others (cluster tiers, a
tier with a codec, whose stored bytes are encoded) read the whole blob and
copy the ranges out. Nothing is staged: a block read this way stays where
it is (a reader that needs whole blocks again and again should
`prefetch` them instead).

Like a load, a range read is a use of its blocks (`touch`, the placement
policy's access counted once per request id); the blocks are held while
they are read, so no eviction moves them underneath. A block that is not
where the placement said (moved by a demotion meanwhile) is looked for in
the other tiers, fastest first. Faults are outcomes: MISSING (not cached),
CORRUPT (a range outside the stored block, or a checksum that failed),
FAILED (an I/O error); the caller's destinations of a block that is not
DONE hold unspecified bytes.

Counted in the cache's stats: `range_blocks` (blocks read this way) and,
per tier, `tiers[name]["range_bytes"]` (the bytes it delivered into the
caller's ranges; the tier's own counters say what its medium read, e.g.
nvme's `bytes_read`, in whole verified chunks).

Acts on the cache's core (ucm/cache/core.py); the locking rules are the
core's.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ucm.adapters.base import SharedSlots, Status, read_range
from ucm.api import Key, Outcome, RangeRead, check_keys, check_ranges, check_request_id
from ucm.cache.core import CacheCore

log = logging.getLogger(__name__)

# Ranges of one block closer than this are read as one span (the gap read
# through): a medium that verifies whole chunks would read a shared chunk
# once per range otherwise, and a read of a small gap costs less than
# another I/O.
MERGE_GAP = 32 * 1024

_OUTCOME = {Status.OK: Outcome.DONE, Status.NOT_FOUND: Outcome.MISSING, Status.CORRUPT: Outcome.CORRUPT,
            Status.FAILED: Outcome.FAILED}


class RangeReader:
    """read_ranges."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core

    def read_ranges(self, keys: Sequence[Key], offsets: Sequence[Sequence[int]], dsts: Sequence[Sequence[Any]],
                    request_id: Optional[str] = None) -> list[RangeRead]:
        """Copies, per block i and range j, bytes [offsets[i][j],
        offsets[i][j] + len(dsts[i][j])) of block keys[i] into dsts[i][j]
        (ucm.api.CacheAPI.read_ranges)."""
        keys = check_keys(keys)
        offsets, views = check_ranges(keys, offsets, dsts)
        request_id = check_request_id(request_id)
        core = self._core
        core.check_open()
        out: list[RangeRead] = [RangeRead(Outcome.MISSING) for _ in keys]
        if not keys:
            return out
        core.plans.adopt_shared(keys, range(len(keys)))
        by_tier: dict[int, list[int]] = {}
        with core.meta:
            core.record_locked(keys, None, request_id)
            for i, k in enumerate(keys):
                t = core.placement.where(k)
                if t is not None:
                    by_tier.setdefault(t, []).append(i)
            held = [keys[i] for idx in by_tier.values() for i in idx]
            core.placement.hold(held)
        try:
            for t, idx in sorted(by_tier.items()):
                for i in idx:
                    out[i] = self._read_block_ranges(keys[i], t, offsets[i], views[i])
        finally:
            with core.meta:
                core.placement.unhold(held)
        with core.meta:
            core.placement.touch([k for k, r in zip(keys, out) if r.outcome is Outcome.DONE])
        for r in out:
            if r.outcome is Outcome.DONE:
                core.counters.add("range_blocks", 1)
                core.counters.add(f"range_bytes.{r.tier}", r.bytes)  # stats() files it under its tier
        core.counters.add_served(r.tier for r in out if r.outcome is Outcome.DONE and r.tier is not None)
        core.counters.add("failed", sum(r.outcome is Outcome.FAILED for r in out))
        core.plans.drain_dropped()
        return out

    def _read_block_ranges(self, key: Key, first: int, offsets: Sequence[int],
                           views: list[memoryview]) -> RangeRead:
        """One block's ranges from tier `first`, else (moved meanwhile) from
        the first other tier that has it."""
        core = self._core
        n = sum(len(v) for v in views)
        order = [first] + [t for t in range(len(core.adapters)) if t != first]
        for t in order:
            adapter = core.adapters[t]
            gap = 0 if isinstance(adapter, SharedSlots) else MERGE_GAP  # slots are read in place: no chunks
            spans = merged_spans(offsets, [len(v) for v in views], gap)
            # A span that is one range is read straight into its destination;
            # a merged one through a buffer, then copied out.
            bufs = [views[m[0]] if len(m) == 1 and end - start == len(views[m[0]]) else bytearray(end - start)
                    for start, end, m in spans]
            try:
                statuses = read_range(adapter, [key] * len(spans), [s[0] for s in spans], bufs)
            except Exception:
                log.exception("ucm: a range read from tier %s failed", core.tier_names[t])
                return RangeRead(Outcome.FAILED, core.tier_names[t])
            if all(s is Status.OK for s in statuses):
                for (start, _, members), buf in zip(spans, bufs):
                    if isinstance(buf, bytearray):
                        with memoryview(buf) as b:
                            for j in members:
                                views[j][:] = b[offsets[j] - start:offsets[j] - start + len(views[j])]
                return RangeRead(Outcome.DONE, core.tier_names[t], n)
            bad = next(s for s in statuses if s is not Status.OK)
            if bad is not Status.NOT_FOUND:
                if bad in (Status.CORRUPT, Status.FAILED) and self._whole_size(t, key, offsets, views):
                    core.plans.forget(key, t)  # a bad copy, not a bad range: the tier's copy is dropped
                    if bad is Status.CORRUPT:
                        core.counters.add("corrupt", 1)
                return RangeRead(_OUTCOME[bad], core.tier_names[t])
        return RangeRead(Outcome.MISSING)

    def _whole_size(self, t: int, key: Key, offsets: Sequence[int], views: list[memoryview]) -> bool:
        """Whether every range lies inside the stored block (so a CORRUPT
        answer was the bytes, not the caller's range)."""
        core = self._core
        try:
            size = core.adapters[t].size_of(key)
        except Exception:  # unknown size: the bad answer is kept, the tier's copy is not forgotten
            log.warning("ucm: asking tier %s for a block's size failed", core.tier_names[t], exc_info=True)
            return False
        return size is not None and all(o + len(v) <= size for o, v in zip(offsets, views))


def merged_spans(offsets: Sequence[int], lengths: Sequence[int],
                 gap: int = MERGE_GAP) -> list[tuple[int, int, list[int]]]:
    """The ranges (offsets[j], lengths[j]) merged into spans (start, end,
    the indexes of the ranges inside), in offset order, where the gap
    between two is below `gap`."""
    spans: list[tuple[int, int, list[int]]] = []
    for j in sorted(range(len(offsets)), key=lambda j: offsets[j]):
        start, end = offsets[j], offsets[j] + lengths[j]
        if spans and start - spans[-1][1] < gap:
            s0, e0, members = spans[-1]
            spans[-1] = (s0, max(e0, end), members + [j])
        else:
            spans.append((start, end, [j]))
    return spans
