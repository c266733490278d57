"""A DRAM tier full of one block size takes a whole batch of a second size:
UnifiedCache over the real dram (and nvme) adapters.

Placement makes room by bytes; the arena needs whole extents for the new
size class. After the evictions Placement planned ran, the last extent the
second size needs still holds a few blocks of the first size, so several
writes of the batch find no slot at once and are reconciled together, each
asking the arena which blocks to give up (`victims_for`). The first answer
empties that extent; the others must wait for it rather than evict blocks of
the batch just written."""
import hashlib

import pytest

from ucm.cache.unified import Outcome, UnifiedCache

KiB = 1024
A, B = 64 * KiB, 96 * KiB


def blocks(tag, n, size):
    keys = [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(n)]
    return keys, [hashlib.shake_128(k).digest(size) for k in keys]


def cfg(nvme_dir):
    tiers = [{"adapter": "dram", "capacity": "4MiB"}]  # 8 extents of 512 KiB: 8 blocks of A, or 5 of B, each
    if nvme_dir is not None:
        tiers.append({"adapter": "nvme", "capacity": "64MiB",
                      "options": {"path": nvme_dir, "region_size": "1MiB", "io_chunk": "256KiB"}})
    return {"tiers": tiers, "landing_tier": "dram", "policy": {"name": "lru"}}


@pytest.mark.parametrize("below", ["none", "nvme"])
def test_a_whole_batch_of_a_second_size_lands_in_a_full_dram_tier(below, nvme_dir):
    with UnifiedCache(cfg(nvme_dir if below == "nvme" else None)) as c:
        a_keys, a_data = blocks("a", 64, A)
        assert c.store(a_keys, a_data).wait(30) == [Outcome.DONE] * 64
        assert c.locate(a_keys) == ["dram"] * 64  # every extent holds blocks of A
        b_keys, b_data = blocks("b", 8, B)
        assert c.store(b_keys, b_data).wait(30) == [Outcome.DONE] * 8
        assert c.locate(b_keys) == ["dram"] * 8
        out = [bytearray(B) for _ in b_keys]
        assert c.load(b_keys, out).wait(30) == [Outcome.DONE] * 8
        assert [bytes(o) for o in out] == b_data
