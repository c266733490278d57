"""A document used over and over while fillers stream through the cache
stays cached: UnifiedCache over the real dram and nvme adapters, lru.

The shape of `ucm bench transformers` (its `_evict_to_nvme` and hit trio),
scaled down: per cycle and document, `prefetch` stages the document into
DRAM, it is read there, one-shot filler blocks push it out of DRAM (it stays
on NVMe), and it is read again from NVMe (staged back up). Each document is
used every cycle; the fillers between two uses of it are a small fraction of
what the NVMe tier holds, so lru has no reason to drop it.

It lost whole documents, tail first, once the fillers demoted since the
document's first demotion filled the NVMe tier (round 4 of 5 in the bench):
every later use of the document was credited to its DRAM copy only (the
staging read out of NVMe included), and its DRAM copy leaves DRAM by a drop
(the NVMe copy stays), so on NVMe it kept the recency of its first demotion
and became the lowest tier's lru victim: gone from every tier."""
import hashlib

import numpy as np

from ucm.cache.unified import Outcome, UnifiedCache

KiB, MiB = 1024, 1024 * 1024
SIZE = 256 * KiB
DOCS, BLOCKS = 2, 4
DRAM = 8 * SIZE  # 20 % headroom: about 6 blocks resident
NVME = 32 * MiB  # 8 regions of 4 MiB (15 blocks each), 85 % usable: about 100 blocks
CYCLES = 20  # fillers pushed through NVMe: about 3x its capacity


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": DRAM, "headroom": 0.2, "options": {"prefault": False}},
                      {"adapter": "nvme", "capacity": NVME,
                       "options": {"path": nvme_dir, "region_size": "4MiB", "io_chunk": "1MiB"}}],
            "policy": {"name": "lru"}}


def key(tag, i):
    return hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()


def payload(k):
    return np.frombuffer(hashlib.shake_128(k).digest(SIZE), dtype=np.uint8)


def push_below_dram(c, keys, fillers):
    """One-shot filler blocks, 4 at a time, until no key of `keys` is in DRAM
    (as the bench's `_evict_to_nvme`); returns where the keys are then."""
    fill = np.zeros(SIZE, dtype=np.uint8)
    for _ in range(100):
        tiers = c.locate(keys)
        if "dram" not in tiers:
            break
        for _ in range(4):
            assert c.store([key("filler", next(fillers))], [fill]).wait(60) == [Outcome.DONE]
    c.flush()
    return c.locate(keys)


def test_a_document_used_every_cycle_is_never_dropped_by_the_fillers_between(nvme_dir):
    docs = [[key(f"doc{d}", i) for i in range(BLOCKS)] for d in range(DOCS)]
    fillers = iter(range(10 ** 6))
    bufs = [np.empty(SIZE, dtype=np.uint8) for _ in range(BLOCKS)]
    with UnifiedCache(cfg(nvme_dir)) as c:
        for keys in docs:  # chained, as a connector stores a prompt's blocks
            assert c.store(keys, [payload(k) for k in keys], parent=None).wait(60) == [Outcome.DONE] * BLOCKS
        # The headroom these stores call for is made now: a demotion still running in the background when the
        # first prefetch looks would leave that prefetch's blocks below DRAM (a prefetch of a block whose
        # demotion is in flight does not stage it again), and the first locate would race it.
        c.flush()
        for cycle in range(CYCLES):
            for d, keys in enumerate(docs):
                c.prefetch(keys).wait(60)
                c.flush()
                assert c.locate(keys) == ["dram"] * BLOCKS, (cycle, d, c.stats()["tiers"]["nvme"]["evictions"])
                assert c.load(keys, bufs).wait(60) == [Outcome.DONE] * BLOCKS
                assert push_below_dram(c, keys, fillers) == ["nvme"] * BLOCKS, (cycle, d)
                assert c.load(keys, bufs).wait(60) == [Outcome.DONE] * BLOCKS, (cycle, d)
                assert all(np.array_equal(b, payload(k)) for b, k in zip(bufs, keys))
        st = c.stats()
        assert st["tiers"]["nvme"]["evictions"] > 0  # the fillers did fill NVMe: lru had to choose
        assert st["missing_blocks"] == 0
