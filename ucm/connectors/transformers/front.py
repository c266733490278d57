"""The `hbm` tier of a transformers process in front of a shared cache.

The `hbm` tier is device memory of one process: the service (`ucm serve`)
cannot hold it, and a block in another process's device pool is of no use
here. So when the connector's cache is a `CacheClient` (or a UnifiedCache
without an `hbm` tier) and the model runs on an accelerator, the connector
keeps a process-local `UnifiedCache` whose only tier is an `hbm` pool on the
model's device, under the shared cache's placement policy:

- write-through: every block the process stores goes into the hbm front and
  into the shared cache (where other processes, vLLM included, and later
  runs find it); the front never holds a block the shared cache was not
  asked to store;
- a hit is served from the front for the blocks it holds and from the
  shared cache for the rest; those are then stored into the front, so the
  blocks this process reuses stay in device memory;
- the front's policy evicts by itself; an evicted block is simply dropped
  (the shared cache has it, or lost it under its own policy).

An in-process `UnifiedCache` configured with tiers `[hbm, dram, nvme]`
(landing tier `hbm`) needs no front: its own placement keeps reused blocks
in hbm above DRAM and demotes them on eviction. On CPU the same code runs
with CPU tensors (`device: cpu`), which is what the tests exercise.
"""
from __future__ import annotations

from typing import Any, Optional

from ucm.cache.unified import UnifiedCache

# The front the connector makes by itself when the model is on an accelerator.
DEFAULT_FRONT_BYTES = 1 << 30


def has_hbm_tier(cache: Any) -> bool:
    """Whether `cache` is an in-process UnifiedCache with an hbm tier."""
    return isinstance(cache, UnifiedCache) and "hbm" in cache.tier_names


def policy_of(cache: Any) -> str:
    cfg = getattr(cache, "config", None)
    return getattr(getattr(cfg, "policy", None), "name", None) or "heat"


def make_front(capacity_bytes: int, device: Any, block_tokens: int, policy: str) -> UnifiedCache:
    """A UnifiedCache of one hbm tier of `capacity_bytes` on `device`."""
    return UnifiedCache({
        "block_tokens": block_tokens,
        "landing_tier": "hbm",
        "tiers": [{"adapter": "hbm", "capacity": int(capacity_bytes), "options": {"device": str(device)}}],
        "policy": {"name": policy},
        "io_workers": 1,
    })


def front_bytes(requested: Optional[int], device_type: str) -> int:
    """The front's size: `requested` when given, else DEFAULT_FRONT_BYTES on
    an accelerator and none on the CPU (there DRAM is the fastest memory)."""
    if requested is not None:
        return int(requested)
    return DEFAULT_FRONT_BYTES if device_type != "cpu" else 0
