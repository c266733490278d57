"""Trace replay: drives a placement engine with a request trace and counts hits.

Runs in one thread of the benchmark process; nothing here blocks. The
replay takes every decision through the placement code UnifiedCache uses
(lookup, promote, insert, touch, with the same policies), in metadata mode:
no payload bytes move; each block has the nominal size `block_bytes`.

Per request, in order:
1. `record_request` counts the access of every block (and hands OPT each
   block's next use, precomputed from the trace);
2. `lookup` gives the hit prefix: a block is a hit only if every earlier
   block of the request hit (prefix semantics); the hit blocks are pinned
   for the rest of the request, as a reading engine would lease them;
3. in a stack of tiers, each hit block served below the landing tier is
   offered for promotion;
4. the missing blocks are inserted in order (`insert_run`, one plan), each
   with the previous block as parent, stopping at the first one not placed
   (refused or no room: its descendants would be useless);
5. `touch` reports the request's accesses to the policies;
6. `finish_request` reports the request's output length (from the trace),
   as the engine does when a request ends.
So after a request all its blocks are cached (stored or touched) unless a
policy refused one.

Cost model (`prefill_saved_ratio`): recomputing a block costs
`prefill_ms_per_token x tokens`; loading a hit block from tier t costs
`block_bytes / bandwidth_t`. Every hit is loaded, so a hit saves
`recompute - load` (negative if loading is slower). The ratio is the sum of
savings over the recompute cost of every block occurrence of the trace
(the prefill time of a run without a cache).

`TraceReplay.run_request` is the per-request driver; `execute` is the hook a
replay with real payloads overrides to carry out each plan against adapters
(metadata mode only counts).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.heat import INF, Key
from ucm.placement.base import PlacementEngine
from ucm.placement.plans import Op, Plan
from ucm.bench.cache.traces import BLOCK_TOKENS, TraceRequest

# Nominal KV bytes of one 512-token block: a Llama-3-8B-class model (32 layers,
# 8 KV heads of 128, fp16): 2 x 32 x 8 x 128 x 2 B = 128 KiB per token.
DEFAULT_BLOCK_BYTES = 512 * 128 * 1024
# Prefill of that model on one current datacentre GPU, about 10k tokens/s.
DEFAULT_PREFILL_MS_PER_TOKEN = 0.1
# Load bandwidth into the engine, GB/s: pinned DRAM over PCIe 4 x16, and one
# PCIe 4 NVMe drive. Measure yours with `ucm bench io --json`.
DEFAULT_DRAM_GBPS = 20.0
DEFAULT_NVME_GBPS = 5.0


def block_key(hash_id: int) -> Key:
    """The 16-byte block key (the cache's key size) of a trace hash id."""
    return hash_id.to_bytes(16, "little")


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    block_bytes: int = DEFAULT_BLOCK_BYTES
    tier_gbps: tuple[float, ...] = (DEFAULT_DRAM_GBPS, DEFAULT_NVME_GBPS)

    def __post_init__(self) -> None:
        if self.prefill_ms_per_token <= 0:
            raise ArgumentError(
                f"prefill_ms_per_token must be > 0, got {self.prefill_ms_per_token}")
        if self.block_bytes <= 0:
            raise ArgumentError(f"block_bytes must be > 0, got {self.block_bytes}")
        if not self.tier_gbps or any(g <= 0 for g in self.tier_gbps):
            raise ArgumentError(f"tier bandwidths must be > 0 GB/s, got {self.tier_gbps}")

    def recompute_ms(self, tokens: int) -> float:
        return self.prefill_ms_per_token * tokens

    def load_ms(self, tier: int) -> float:
        return self.block_bytes / (self.tier_gbps[tier] * 1e9) * 1e3


@dataclass(slots=True)
class ReplayResult:
    """Totals of one replay; ratios are over block occurrences (or tokens)."""

    policy: str
    tiers: list[dict] = field(default_factory=list)  # name, capacity_tokens, _blocks, _bytes
    block_bytes: int = 0
    requests: int = 0
    blocks: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    tier_hits: list[int] = field(default_factory=list)
    tier_bytes_written: list[int] = field(default_factory=list)
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    refused: int = 0  # requests whose insertion stopped early
    saved_ms: float = 0.0
    recompute_ms: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hits(self) -> int:
        return sum(self.tier_hits)

    @property
    def misses(self) -> int:
        return self.blocks - self.hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    @property
    def prefill_saved_ratio(self) -> float:
        return self.saved_ms / self.recompute_ms if self.recompute_ms else 0.0

    def _tier_value(self, values: list[int], name: str) -> int:
        for t, spec in enumerate(self.tiers):
            if spec["name"] == name:
                return values[t]
        return 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("saved_ms")
        d.pop("recompute_ms")
        d.pop("tier_hits")
        d.pop("tier_bytes_written")
        if len(self.tiers) == 1:
            d["capacity_tokens"] = self.tiers[0]["capacity_tokens"]
        for spec in self.tiers:
            d[f"{spec['name']}_tokens"] = spec["capacity_tokens"]
        d.update(
            hits=self.hits,
            misses=self.misses,
            hit_ratio=self.hit_ratio,
            token_hit_ratio=self.token_hit_ratio,
            dram_hits=self._tier_value(self.tier_hits, "dram"),
            nvme_hits=self._tier_value(self.tier_hits, "nvme"),
            dram_bytes_written=self._tier_value(self.tier_bytes_written, "dram"),
            nvme_bytes_written=self._tier_value(self.tier_bytes_written, "nvme"),
            prefill_saved_ratio=self.prefill_saved_ratio,
        )
        return d


def next_uses(requests: Sequence[TraceRequest], start: int = 0) -> list[list[float]]:
    """For each block occurrence, the clock of the next request holding the
    same id (INF if none); request i runs at clock `start + i + 1`."""
    out: list[list[float]] = [[] for _ in requests]
    seen: dict[int, float] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        out[i] = [seen.get(h, INF) for h in ids]
        clock = float(start + i + 1)
        for h in ids:
            seen[h] = clock
    return out


class TraceReplay:
    """Replays requests through one placement engine (metadata mode)."""

    def __init__(self, placement: PlacementEngine, cost: CostModel, policy_name: str = "",
                 block_tokens: int = BLOCK_TOKENS,
                 capacity_tokens: Optional[Sequence[int]] = None) -> None:
        if block_tokens <= 0:
            raise ArgumentError(f"block_tokens must be > 0, got {block_tokens}")
        if len(cost.tier_gbps) < placement.tier_count:
            raise ArgumentError(f"cost model has {len(cost.tier_gbps)} tier bandwidths, "
                                f"placement has {placement.tier_count} tiers")
        self.placement = placement
        self.cost = cost
        self.block_tokens = block_tokens
        self.result = ReplayResult(policy=policy_name, block_bytes=cost.block_bytes)
        n = placement.tier_count
        self.result.tier_hits = [0] * n
        self.result.tier_bytes_written = [0] * n
        for t in range(n):
            cap = placement.capacity_bytes(t)
            toks = (capacity_tokens[t] if capacity_tokens is not None
                    else cap // cost.block_bytes * block_tokens)
            self.result.tiers.append({"name": placement.tier_name(t), "capacity_tokens": toks,
                                      "capacity_blocks": cap // cost.block_bytes,
                                      "capacity_bytes": cap})
        self._load_ms = [cost.load_ms(t) for t in range(n)]

    def execute(self, plan: Plan) -> None:
        """Carries out one plan. Metadata mode moves nothing and counts the
        demotions; a replay with payloads overrides this to run each step
        against the adapters (WRITE from the request's bytes, MOVE, COPY,
        DROP) and to report a failed step with `placement.remove`."""
        r = self.result
        for step in plan:
            if step.op is Op.MOVE:
                r.demotions += 1

    def run_request(self, keys: Sequence[Key], tokens: Sequence[int],
                    next_use: Optional[Sequence[float]] = None,
                    output_tokens: Optional[int] = None) -> list[int]:
        """One request: returns the serving tier of each hit block (the hit
        prefix is `len` of the result). `output_tokens`, if given, is
        reported when the request is done, after its blocks are placed."""
        p = self.placement
        p.record_request(keys, next_use)
        n = p.lookup(keys)
        hit = keys[:n]
        served = [p.where(k) for k in hit]
        p.hold(hit)  # a request's hits stay where they are while it places its blocks
        try:
            landing = p.landing
            for k, t in zip(hit, served):
                if t > landing:
                    d = p.promote(k)
                    self.execute(d.plan)
                    self.result.promotions += d.placed
            parent = keys[n - 1] if n else None
            todo = keys[n:]  # (a key resident after a miss, if ids are not chained, is skipped)
            if todo:
                run = p.insert_run(todo, parent, [self.cost.block_bytes] * len(todo))
                self.execute(run.plan)
                if run.stop < len(todo):
                    self.result.refused += 1
            p.touch(keys)
        finally:
            p.unhold(hit)
        if output_tokens is not None:
            p.finish_request(keys, output_tokens)
        r = self.result
        r.requests += 1
        r.blocks += len(keys)
        r.tokens += sum(tokens)
        cost = self.cost
        for t, tok in zip(served, tokens):
            r.tier_hits[t] += 1
            r.hit_tokens += tok
            r.saved_ms += cost.recompute_ms(tok) - self._load_ms[t]
        r.recompute_ms += cost.recompute_ms(sum(tokens))
        for t in range(p.tier_count):
            r.tier_bytes_written[t] = p.counters(t).bytes_written
        r.evictions = sum(p.counters(t).evictions for t in range(p.tier_count))
        return served

    def replay(self, requests: Sequence[TraceRequest]) -> ReplayResult:
        """Runs every request in order; returns the totals (also `self.result`)."""
        t0 = time.perf_counter()
        nus = next_uses(requests, start=self.placement.heat.now)
        bt = self.block_tokens
        for req, nu in zip(requests, nus):
            keys = [block_key(h) for h in req.hash_ids]
            self.run_request(keys, req.block_tokens(bt), nu, req.output_length)
        self.result.elapsed_s += time.perf_counter() - t0
        return self.result
