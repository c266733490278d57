"""Trace replay through the cache's public API in the connector's call
sequence: `ucm bench trace --bytes SIZE --live`.

The metadata replay (ucm/bench/cache/replay.py) drives `Placement` directly, once
per request, in the order it chooses. An engine does not: the vLLM
connector begins the request from the scheduler's lookup, pins the hit,
loads it in a separate call (`read_slots`: leases, staging blocks held
below DRAM into it) and saves the rest chunk by chunk as chunked prefill
computes it (`write_slots`, each chunk continuing the last), then reports
the finish. This replay makes exactly those calls on a real UnifiedCache,
with real payloads of SIZE bytes per block, so the policy's figures can be
compared between the two call patterns on one trace (`live_*` counters,
`ucm bench trace --json`).

Per request (id `r<index>`):
1. `begin_request(id, keys)`: the one access the policy counts;
2. `lookup(keys)` = n, `pin(keys[:n])`, `locate(keys[:n])` (the serving tiers);
3. `read_slots(keys[:n], request_id=id)`: the hit is the leading run of
   DONE blocks, each checked against its payload (`live_mismatches` must
   be 0);
4. `write_slots` of the remaining blocks in chunks of `chunk_blocks`, each
   with the previous block as parent and the request's id, stopping after a
   chunk that was not stored whole;
5. `finish(keys, output_length, request_id=id)`, `unpin(keys[:n])`.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ucm.api import Outcome
from ucm.bench.cache.payload import cache_config, payload
from ucm.bench.cache.replay import CostModel, ReplayResult, block_key
from ucm.cache.unified import UnifiedCache
from ucm.errors import ArgumentError
from ucm.bench.cache.traces import BLOCK_TOKENS, TraceRequest

DEFAULT_CHUNK_BLOCKS = 4  # 2,048-token prefill chunks at 512-token blocks: vLLM's default


@dataclass(slots=True)
class LiveCounts:
    mismatches: int = 0  # a hit block read back with other bytes than its payload
    short_reads: int = 0  # lookup said n blocks, fewer came back DONE
    write_calls: int = 0  # write_slots calls (chunks)
    stored_blocks: int = 0
    refused_chunks: int = 0  # a chunk not stored whole (the rest of its request is not saved)


def run_live(requests: Sequence[TraceRequest], policy: str, tiers: Sequence[tuple[str, int, int]],
             cost: CostModel, block_tokens: int = BLOCK_TOKENS, nvme_dir: Optional[str] = None,
             chunk_blocks: int = DEFAULT_CHUNK_BLOCKS) -> tuple[ReplayResult, LiveCounts]:
    """Replays `requests` through UnifiedCache's API over `tiers` = [(name,
    tokens, bytes)] (dram, then optionally nvme) with payloads of
    `cost.block_bytes` bytes per block."""
    names = [name for name, _, _ in tiers]
    if names not in (["dram"], ["dram", "nvme"]):
        raise ArgumentError(f"a live replay runs on dram or dram over nvme, got tiers {names}")
    if chunk_blocks <= 0:
        raise ArgumentError(f"chunk_blocks must be > 0, got {chunk_blocks}")
    size = cost.block_bytes
    result = ReplayResult(policy=policy, block_bytes=size)
    result.tier_hits = [0] * len(tiers)
    result.tier_bytes_written = [0] * len(tiers)
    for name, tok, nbytes in tiers:
        result.tiers.append({"name": name, "capacity_tokens": tok, "capacity_blocks": nbytes // size,
                             "capacity_bytes": nbytes})
    counts = LiveCounts()
    load_ms = [cost.load_ms(t) for t in range(len(tiers))]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ucm-live-", dir=nvme_dir) as tmp:
        cfg = cache_config(policy, [b for _, _, b in tiers], size, tmp)
        with UnifiedCache(cfg) as cache:
            for t, (name, _, nbytes) in enumerate(tiers):
                got = cache.placement.capacity_bytes(t)
                if got != nbytes:
                    raise ArgumentError(f"{name}: the adapter offers {got} bytes, the replay needs exactly {nbytes}")
            for i, req in enumerate(requests):
                keys = [block_key(h) for h in req.hash_ids]
                tokens = req.block_tokens(block_tokens)
                served = _request(cache, f"r{i}", keys, req.output_length, size, chunk_blocks, counts)
                result.requests += 1
                result.blocks += len(keys)
                result.tokens += sum(tokens)
                for t, tok in zip(served, tokens):
                    result.tier_hits[t] += 1
                    result.hit_tokens += tok
                    result.saved_ms += cost.recompute_ms(tok) - load_ms[t]
                result.recompute_ms += cost.recompute_ms(sum(tokens))
            stats = cache.stats()
            cache.flush()
    for t, (name, _, _) in enumerate(tiers):
        tier = stats["tiers"][name]
        result.tier_bytes_written[t] = tier["bytes_written"]
        result.evictions += tier["evictions"]
        result.promotions += tier["promotions_in"]
        result.demotions += tier["demotions_in"]
    result.refused = counts.refused_chunks
    result.elapsed_s = time.perf_counter() - t0
    return result, counts


def _request(cache: UnifiedCache, rid: str, keys: list, output_tokens: int, size: int,
             chunk_blocks: int, counts: LiveCounts) -> list[int]:
    """One request in the connector's call sequence; the serving tier index
    of each hit block."""
    cache.begin_request(rid, keys)
    n = cache.lookup(keys)
    hit = keys[:n]
    cache.pin(hit)
    try:
        where = cache.locate(hit)
        good: list[bool] = [False] * n

        def check(first: int, slots: list, arena) -> None:
            view = memoryview(arena)
            for j, s in enumerate(slots):
                if s is not None:
                    off, length = s
                    ok = view[off:off + length] == payload(hit[first + j], size)
                    good[first + j] = ok
                    counts.mismatches += not ok

        res = cache.read_slots(hit, [size] * n, check, request_id=rid) if n else []
        served = 0
        while served < n and res[served] is Outcome.DONE and good[served]:
            served += 1
        counts.short_reads += served < n
        for start in range(served, len(keys), chunk_blocks):
            chunk = keys[start:start + chunk_blocks]

            def fill(first: int, slots: list, arena, chunk: list = chunk) -> None:
                view = memoryview(arena)
                for j, s in enumerate(slots):
                    if s is not None:
                        off, length = s
                        view[off:off + length] = payload(chunk[first + j], size)

            counts.write_calls += 1
            out = cache.write_slots(chunk, [size] * len(chunk), fill, parent=keys[start - 1] if start else None,
                                    request_id=rid)
            counts.stored_blocks += sum(o is Outcome.DONE for o in out)
            if any(o is not Outcome.DONE for o in out):
                counts.refused_chunks += 1
                break
        cache.finish(keys, output_tokens, request_id=rid)
        names = cache.tier_names
        return [names.index(w) for w in where[:served]]
    finally:
        cache.unpin(hit)
