"""UnifiedCache.read_slots in parts: a hit longer than the landing tier
holds at once is staged and handed to `fill` part by part (at most 1/8 of
the landing tier each, at least one block), as the service's client cuts
its calls, so no block is lost for want of room; the call is one access."""
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache
from ucm.cache.slots import READ_PART_SHARE
from support import SIZE, chain


def _cache(nvme_dir, dram_blocks):
    return UnifiedCache({"block_tokens": 16, "policy": {"name": "lru"}, "tiers": [
        {"adapter": "dram", "capacity": dram_blocks * SIZE + 8192, "options": {"prefault": False}},
        {"adapter": "nvme", "capacity": "16MiB", "options": {"path": nvme_dir, "region_size": "1MiB"}}]})


def _reader(out, firsts, fail_at=None):
    def fill(first, slots, arena):
        firsts.append(first)
        if first == fail_at:
            raise RuntimeError("injected copy failure")
        m = memoryview(arena)
        for i, s in enumerate(slots):
            if s is not None:
                out[first + i] = bytes(m[s[0]:s[0] + s[1]])
    return fill


def test_a_hit_longer_than_dram_comes_back_whole_part_by_part(nvme_dir):
    keys, data = chain(10, 1)
    with _cache(nvme_dir, 3) as cache:
        assert cache.store(keys, data).wait(10) == [Outcome.DONE] * 10
        cache.flush()
        assert cache.locate(keys).count("nvme") >= 7
        before = cache.stats()["requests"]
        out, firsts = {}, []
        assert cache.read_slots(keys, [SIZE] * 10, _reader(out, firsts)) == [Outcome.DONE] * 10
        assert [out[i] for i in range(10)] == data
        # 3 blocks of DRAM / 8 is less than a block: one block a part.
        assert 3 * SIZE // READ_PART_SHARE < SIZE and firsts == list(range(10))
        assert cache.stats()["requests"] == before + 1  # one access, however many parts


def test_a_part_whose_fill_raises_fails_alone(nvme_dir):
    keys, data = chain(6, 2)
    with _cache(nvme_dir, 3) as cache:
        cache.store(keys, data).wait(10)
        out, firsts = {}, []
        got = cache.read_slots(keys, [SIZE] * 6, _reader(out, firsts, fail_at=2))
        assert got == [Outcome.DONE] * 2 + [Outcome.FAILED] + [Outcome.DONE] * 3
        assert [out[i] for i in (0, 1, 3, 4, 5)] == [data[i] for i in (0, 1, 3, 4, 5)]


def test_a_large_landing_tier_reads_in_few_parts(nvme_dir):
    keys, data = chain(10, 3)
    with _cache(nvme_dir, 80) as cache:  # 80 blocks / 8: parts of 10 blocks
        cache.store(keys, data).wait(10)
        out, firsts = {}, []
        assert cache.read_slots(keys, [SIZE] * 10, _reader(out, firsts)) == [Outcome.DONE] * 10
        assert firsts == [0] and [out[i] for i in range(10)] == data
