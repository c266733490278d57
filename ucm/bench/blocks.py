"""Blocks that benches and probes put into a cache to set up a hit: chains
of deterministic keys, filler that pushes a set of blocks below DRAM, and a
count of the tiers `locate` names.

Works on any cache with the `CacheAPI` calls it uses (`store`, `locate`,
`flush`): a `UnifiedCache` in process or a client of `ucm serve`. Runs in
the caller's thread; `push_below_dram` blocks until the stores are done.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Sequence


def chain(n: int, seed: int) -> list[bytes]:
    """`n` 16-byte keys, each the BLAKE2b of the one before and its index,
    starting from `seed`: the same chain for the same seed, in any process
    (the staging bench's client script carries this function's source)."""
    keys, prev = [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    return keys


def push_below_dram(cache: Any, keys: Sequence[bytes], block_bytes: int, limit: int,
                    per_round: int = 16, filler: Optional[Any] = None) -> list[Optional[str]]:
    """Stores one-shot filler blocks (random keys, `per_round` one-block
    stores a round, at most `limit` rounds) until `locate` puts every key of
    `keys` on a tier below DRAM; then flushes. Returns where `keys` are.
    `filler`: the filler's bytes (default `block_bytes` zeros)."""
    if filler is None:
        import numpy as np

        filler = np.zeros(block_bytes, dtype=np.uint8)
    tiers = cache.locate(keys)
    for _ in range(limit):
        if all(t is not None and t != "dram" for t in tiers):
            break
        for _ in range(per_round):
            cache.store([os.urandom(16)], [filler]).wait(60)
        tiers = cache.locate(keys)
    cache.flush()
    return cache.locate(keys)


def tier_counts(tiers: Sequence[Optional[str]]) -> dict[str, int]:
    """How many of `locate`'s answers name each tier ('None': nowhere)."""
    c: dict[str, int] = {}
    for t in tiers:
        c[str(t)] = c.get(str(t), 0) + 1
    return c
