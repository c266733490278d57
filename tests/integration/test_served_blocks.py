"""Per-tier served counts (`stats()["tiers"][name]["served_blocks"]`) over
real dram and nvme tiers: a block held only on NVMe and staged up by a
load, a lease or a stream counts as served by NVMe (its policy hit is
DRAM's, where it is once staged); a range read counts in the tier it was
read from; a block already in DRAM counts as DRAM's. Before, only `hits`
existed and filed every NVMe load under DRAM."""
from test_layer_stream import LAYER, LAYERS, SIZE, cfg, on_nvme
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache


def served(c):
    return {name: t["served_blocks"] for name, t in c.stats()["tiers"].items()}


def test_a_load_staged_up_from_nvme_is_served_by_nvme(nvme_dir):
    keys, _ = on_nvme(nvme_dir, 2, 31)
    with UnifiedCache(cfg(nvme_dir)) as c:
        hits = c.stats()["tiers"]["dram"]["hits"]
        bufs = [bytearray(SIZE) for _ in keys]
        assert c.load(keys, bufs).wait(30) == [Outcome.DONE] * 2
        assert served(c) == {"dram": 0, "nvme": 2}
        assert c.locate(keys) == ["dram"] * 2 and c.stats()["tiers"]["dram"]["hits"] == hits + 2
        assert c.load(keys, bufs).wait(30) == [Outcome.DONE] * 2
        assert served(c) == {"dram": 2, "nvme": 2}


def test_leases_streams_and_range_reads_count_the_tier_the_block_came_from(nvme_dir):
    keys, _ = on_nvme(nvme_dir, 3, 32)
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.read_ranges(keys[2:], [[LAYER]], [[bytearray(64)]])[0].tier == "nvme"  # not staged
        assert served(c) == {"dram": 0, "nvme": 1}
        leases = c.acquire(keys[:1])
        assert leases[0] is not None
        c.release(leases)
        assert served(c) == {"dram": 0, "nvme": 2}
        s = c.stream_slots(keys[1:2], [SIZE], LAYERS)
        try:
            assert s.outcomes(10.0) == [Outcome.DONE]
        finally:
            s.release()
        assert served(c) == {"dram": 0, "nvme": 3}
        leases = c.acquire(keys[:2])  # both in DRAM now
        c.release(leases)
        assert served(c) == {"dram": 2, "nvme": 3}
