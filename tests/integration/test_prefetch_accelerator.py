"""The prefetch accelerator over real dram and nvme tiers: a request seen
with its prefix on NVMe only is staged into DRAM in the background; the
counters tell what was used and what was wasted."""
import time

from support import chain
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache

SIZE = 64 * 1024


def cfg(nvme_dir, **options):
    return {"tiers": [{"adapter": "dram", "capacity": "512KiB"},  # 8 slots of 64 KiB
                      {"adapter": "nvme", "capacity": "16MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"},
            "accelerators": [{"name": "prefetch", "options": options}]}


def counters(cache):
    return cache.stats()["accelerators"]["prefetch"]


def wait_for(cache, name, value, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while counters(cache)[name] < value:
        assert time.monotonic() < end, f"{name} stayed {counters(cache)[name]} < {value}"
        time.sleep(0.01)


def on_nvme_only(cache, seed, n):
    """n blocks stored, then pushed down to NVMe by 8 more."""
    keys, data = chain(n, seed)
    assert cache.store(keys, data).wait(30) == [Outcome.DONE] * n
    other, odata = chain(8, seed + 100)
    assert cache.store(other, odata).wait(30) == [Outcome.DONE] * 8
    assert cache.locate(keys) == ["nvme"] * n
    return keys, data


def test_a_request_seen_with_its_prefix_on_nvme_is_staged_and_read_from_dram(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, data = on_nvme_only(cache, 1, 4)
        cache.begin_request("r1", keys)
        wait_for(cache, "blocks_staged", 4)
        assert cache.locate(keys) == ["dram"] * 4
        got = [bytearray(SIZE) for _ in keys]
        assert cache.load(keys, got, request_id="r1").wait(30) == [Outcome.DONE] * 4
        assert [bytes(g) for g in got] == data
        cache.finish(keys, 10, request_id="r1")
        c = counters(cache)
        assert (c["requests_staged"], c["blocks_issued"], c["blocks_used"], c["blocks_wasted"]) == (1, 4, 4, 0)
        assert c["bytes_issued"] >= 4 * SIZE and c["errors"] == 0 and c["blocks_inflight"] == 0


def test_staged_blocks_a_request_never_read_are_counted_wasted(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, _ = on_nvme_only(cache, 2, 3)
        cache.begin_request("r2", keys)
        wait_for(cache, "blocks_staged", 3)
        cache.finish(keys, 10, request_id="r2")
        c = counters(cache)
        assert c["blocks_wasted"] == 3 and c["bytes_wasted"] >= 3 * SIZE and c["blocks_used"] == 0


def test_a_request_over_the_inflight_bound_is_skipped_and_a_dram_hit_issues_nothing(nvme_dir):
    with UnifiedCache(cfg(nvme_dir, max_inflight_blocks=2)) as cache:
        keys, _ = on_nvme_only(cache, 3, 4)
        cache.begin_request("r3", keys)
        c = counters(cache)
        assert c["requests_skipped"] == 1 and c["blocks_issued"] == 0
        assert cache.locate(keys) == ["nvme"] * 4
        hot, hdata = chain(2, 9)
        assert cache.store(hot, hdata).wait(30) == [Outcome.DONE] * 2
        cache.begin_request("r4", hot)  # in DRAM already: nothing to stage
        assert counters(cache)["requests_staged"] == 0


def test_prefetch_stops_at_the_end_of_the_cached_prefix(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, _ = on_nvme_only(cache, 4, 2)
        more, _ = chain(2, 5)
        cache.begin_request("r5", [more[0]] + keys)  # the first block is not cached: no hit at all
        assert counters(cache)["blocks_issued"] == 0


def test_stagings_beyond_the_staged_bytes_budget_are_skipped_not_thrashed(nvme_dir):
    """Half of the 512 KiB DRAM tier by default: 4 staged-but-unread blocks
    of 64 KiB. A second request whose 3 blocks would pass it is not staged
    (counted), so it cannot evict the first request's staged blocks."""
    with UnifiedCache(cfg(nvme_dir)) as cache:
        a, _ = on_nvme_only(cache, 11, 3)
        b, _ = on_nvme_only(cache, 12, 3)
        assert cache.locate(a + b) == ["nvme"] * 6
        cache.begin_request("ra", a)
        wait_for(cache, "blocks_staged", 3)
        cache.begin_request("rb", b)
        c = counters(cache)
        assert c["requests_staged"] == 1 and c["requests_over_budget"] == 1 and c["blocks_issued"] == 3
        assert cache.locate(a) == ["dram"] * 3 and cache.locate(b) == ["nvme"] * 3
        got = [bytearray(SIZE) for _ in a]
        assert cache.load(a, got, request_id="ra").wait(30) == [Outcome.DONE] * 3  # read: budget back
        cache.begin_request("rb2", b)
        assert counters(cache)["requests_staged"] == 2
