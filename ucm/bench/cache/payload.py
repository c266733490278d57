"""Trace replay with real payloads: `ucm bench trace --bytes SIZE`.

Runs in the benchmark process, one thread, like the metadata replay it
extends: the same `TraceReplay.run_request` takes every decision through the
placement of a real UnifiedCache (DRAM tier: the `dram` adapter; second
tier: the `nvme` adapter in a temporary directory), and each plan is carried
out against those adapters by the cache's own plan executor (WRITE, MOVE,
COPY, DROP; a failed step is taken back out of the placement). Blocks are
scaled down to `SIZE` bytes each; a tier of N blocks in metadata mode holds
N blocks here too, so hit and miss counts must equal the metadata replay's.

Every block's payload is derived from its key (BLAKE2b of the key, repeated),
so it is known without being kept. After each request, every hit block is
read back from the tier now holding it and compared with that payload; a
difference is counted in `payload_mismatches` (must be 0), a read that does
not come back OK in `payload_read_errors`.
"""
from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ucm.bench.cache.replay import CostModel, ReplayResult, TraceReplay
from ucm.cache.unified import UnifiedCache
from ucm.adapters.base import Status
from ucm.errors import ArgumentError
from ucm.placement.heat import Key
from ucm.placement.plans import Op, Plan
from ucm.bench.cache.traces import BLOCK_TOKENS, TraceRequest

NVME_REGION_BLOCKS = 16  # blocks per NVMe log region
NVME_MIN_REGIONS = 8  # the log needs slack regions to reclaim in place


def payload(key: Key, size: int) -> bytes:
    """The bytes of the block `key`: its BLAKE2b-256 digest repeated."""
    digest = hashlib.blake2b(key, digest_size=32).digest()
    reps, rest = divmod(size, len(digest))
    return digest * reps + digest[:rest]


@dataclass(slots=True)
class PayloadCounts:
    bytes_written: int = 0  # WRITE, MOVE and COPY steps into an adapter
    bytes_read: int = 0  # hit blocks read back
    blocks_read: int = 0
    mismatches: int = 0  # read back with other bytes than written
    read_errors: int = 0  # a hit block whose read did not come back OK
    failed_steps: int = 0  # plan steps the adapters refused or failed


def cache_config(policy: str, tier_bytes: Sequence[int], block_bytes: int, nvme_dir: str) -> dict:
    """UnifiedCache config for the replay: DRAM of `tier_bytes[0]`, and NVMe
    of `tier_bytes[1]` (logical capacity, exactly) if given."""
    dram: dict = {"prefault": False}
    if block_bytes % 4096 == 0 and tier_bytes[0] % block_bytes == 0:
        # extents of one block: the arena covers exactly the blocks asked for
        dram["extent_bytes"] = block_bytes
    tiers: list[dict] = [{"adapter": "dram", "capacity": tier_bytes[0], "options": dram}]
    if len(tier_bytes) > 1:
        want = tier_bytes[1]
        region = NVME_REGION_BLOCKS * block_bytes
        regions = max(NVME_MIN_REGIONS, -(-want // region) * 2)
        medium = regions * region
        # the adapter's logical capacity is int(medium x usable_fraction): make it `want`
        tiers.append({"adapter": "nvme", "capacity": medium,
                      "options": {"path": nvme_dir, "region_size": region,
                                  "usable_fraction": (want + 0.5) / medium}})
    return {"tiers": tiers, "landing_tier": "dram", "policy": {"name": policy}, "io_workers": 1}


class PayloadReplay(TraceReplay):
    """TraceReplay whose plans move real bytes through a UnifiedCache."""

    def __init__(self, cache: UnifiedCache, cost: CostModel, policy_name: str = "",
                 block_tokens: int = BLOCK_TOKENS,
                 capacity_tokens: Optional[Sequence[int]] = None) -> None:
        super().__init__(cache.placement, cost, policy_name, block_tokens, capacity_tokens)
        self.cache = cache
        self.counts = PayloadCounts()
        self._buf = bytearray(cost.block_bytes)

    def execute(self, plan: Plan) -> None:
        size = self.cost.block_bytes
        sources = {s.key: memoryview(payload(s.key, size)) for s in plan if s.op is Op.WRITE}
        if not self.cache.plans.run_plan(plan, sources):
            self.counts.failed_steps += 1
        self.counts.bytes_written += size * sum(s.op is not Op.DROP for s in plan)
        super().execute(plan)

    def run_request(self, keys: Sequence[Key], tokens: Sequence[int],
                    next_use: Optional[Sequence[float]] = None,
                    output_tokens: Optional[int] = None) -> list[int]:
        served = super().run_request(keys, tokens, next_use, output_tokens)
        c, size, buf = self.counts, self.cost.block_bytes, self._buf
        adapters = self.cache.adapters
        for key in keys[:len(served)]:
            t = self.placement.where(key)
            st = adapters[t].get([key], [buf])[0] if t is not None else Status.NOT_FOUND
            if st is not Status.OK:
                c.read_errors += 1
                continue
            c.blocks_read += 1
            c.bytes_read += size
            if buf != payload(key, size):
                c.mismatches += 1
        return served


def run_payload(requests: Sequence[TraceRequest], policy: str,
                tiers: Sequence[tuple[str, int, int]], cost: CostModel,
                block_tokens: int = BLOCK_TOKENS, nvme_dir: Optional[str] = None
                ) -> tuple[ReplayResult, PayloadCounts]:
    """Replays `requests` with real payloads of `cost.block_bytes` per block
    over `tiers` = [(name, tokens, bytes)] (dram, then optionally nvme)."""
    names = [name for name, _, _ in tiers]
    if names not in (["dram"], ["dram", "nvme"]):
        raise ArgumentError(f"a payload replay runs on dram or dram over nvme, got tiers {names}")
    with tempfile.TemporaryDirectory(prefix="ucm-trace-", dir=nvme_dir) as tmp:
        cfg = cache_config(policy, [b for _, _, b in tiers], cost.block_bytes, tmp)
        t0 = time.perf_counter()
        with UnifiedCache(cfg, replay=True) as cache:
            for t, (name, _, nbytes) in enumerate(tiers):
                got = cache.placement.capacity_bytes(t)
                if got != nbytes:
                    raise ArgumentError(f"{name}: the adapter offers {got} bytes, the replay "
                                        f"needs exactly {nbytes}")
            replay = PayloadReplay(cache, cost, policy_name=policy, block_tokens=block_tokens,
                                   capacity_tokens=[tok for _, tok, _ in tiers])
            result = replay.replay(requests)
            cache.flush()
        result.elapsed_s = time.perf_counter() - t0
    return result, replay.counts
