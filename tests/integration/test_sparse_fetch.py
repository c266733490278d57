"""Sparse decode's page fetch (ucm/connectors/transformers/sparse_fetch.py)
over a real UnifiedCache with dram and nvme tiers: the bytes of the picked
pages of one layer come back exactly; the bytes counted per tier equal what
the cache counts itself; a block on NVMe is read by ranges (the medium
reads the chunks covering the pages, not the block) and not staged; a
block that cannot be read is a failed fetch (None), never partial pages."""
import pytest

torch = pytest.importorskip("torch")

from support import chain  # noqa: E402
from ucm.api import Outcome  # noqa: E402
from ucm.cache.unified import UnifiedCache  # noqa: E402
from ucm.connectors.transformers.namespace import BlockLayout  # noqa: E402
from ucm.connectors.transformers.sparse_fetch import PageFetcher, reuse_pages  # noqa: E402

LAY = BlockLayout(num_layers=2, num_kv_heads=2, block_tokens=32, head_dim=64, dtype="float32")  # 64 KiB blocks
PT = 16


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": "512KiB"},  # 8 blocks
                      {"adapter": "nvme", "capacity": "16MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def stored(cache, n, seed):
    keys, _ = chain(n, seed, size=LAY.block_bytes)
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(LAY.shape, generator=g) for _ in keys]
    assert cache.store(keys, blocks).wait(30) == [Outcome.DONE] * n
    return keys, blocks


def expected(blocks, layer, units, kv):
    per = LAY.block_tokens // PT
    return torch.cat([blocks[u // per][layer, kv, :, (u % per) * PT:(u % per + 1) * PT] for u in sorted(units)], dim=1)


def page_bytes(pages):
    return 2 * LAY.num_kv_heads * pages * PT * LAY.head_dim * 4


def test_pages_of_one_layer_from_dram_with_exact_counts(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, blocks = stored(cache, 4, 1)
        f = PageFetcher(cache, LAY, torch.float32, PT, keys, None)
        before = cache.stats()["tiers"]["dram"]["range_bytes"]
        units = [6, 1, 3]  # pages of blocks 0, 1 and 3
        got = f.fetch_pages(1, units, pad=5)
        assert got is not None and got.units == (1, 3, 6)
        assert torch.equal(got.keys, expected(blocks, 1, units, 0))
        assert torch.equal(got.values, expected(blocks, 1, units, 1))
        assert got.positions.tolist() == [5 + u * PT + t for u in (1, 3, 6) for t in range(PT)]
        c = f.counters
        served = cache.stats()["tiers"]["dram"]["range_bytes"] - before
        assert c.bytes_read == {"dram": page_bytes(3)} == {"dram": served}
        assert (c.fetches, c.blocks_read, c.pages_copied, c.failed_fetches) == (1, 3, 3, 0)


def test_reused_pages_with_fresh_ones_equal_a_fetch_of_all_of_them(nvme_dir):
    """A new selection keeps pages 3 and 6 of the last one, drops 1 and
    adds 0 and 5: only 0 and 5 are read, and the gathered pages are the
    bytes and positions a fetch of all of them gives."""
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, blocks = stored(cache, 4, 2)
        f = PageFetcher(cache, LAY, torch.float32, PT, keys, None)
        held = f.fetch_pages(0, [1, 3, 6])
        fresh = f.fetch_pages(0, [5, 0])
        got = reuse_pages(held, fresh, [6, 0, 5, 3], PT)
        whole = f.fetch_pages(0, [0, 3, 5, 6])
        assert got.units == whole.units == (0, 3, 5, 6)
        assert torch.equal(got.keys, expected(blocks, 0, got.units, 0)) and torch.equal(got.keys, whole.keys)
        assert torch.equal(got.values, expected(blocks, 0, got.units, 1)) and torch.equal(got.values, whole.values)
        assert got.positions.tolist() == whole.positions.tolist()
        assert f.counters.pages_copied == 3 + 2 + 4


def test_blocks_on_nvme_are_read_by_ranges_and_not_staged(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, blocks = stored(cache, 3, 2)
        stored(cache, 8, 3)  # pushes the first three down to NVMe
        assert cache.locate(keys) == ["nvme"] * 3
        assert cache.flush(30)  # on the medium, not in the adapter's write buffer
        nvme_before = cache.stats()["tiers"]["nvme"]["adapter"]["bytes_read"]
        f = PageFetcher(cache, LAY, torch.float32, PT, keys, None)
        got = f.fetch_pages(0, [0, 5])  # blocks 0 and 2
        assert got is not None
        assert torch.equal(got.keys, expected(blocks, 0, [0, 5], 0))
        assert torch.equal(got.values, expected(blocks, 0, [0, 5], 1))
        s = cache.stats()
        assert f.counters.bytes_read == {"nvme": page_bytes(2)} == {"nvme": s["tiers"]["nvme"]["range_bytes"]}
        medium = s["tiers"]["nvme"]["adapter"]["bytes_read"] - nvme_before
        assert page_bytes(2) <= medium < 2 * LAY.block_bytes  # the chunks covering the pages, not the blocks
        assert cache.locate(keys) == ["nvme"] * 3  # nothing staged


def test_a_missing_block_fails_the_fetch(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as cache:
        keys, _ = stored(cache, 2, 4)
        lost, _ = chain(1, 99, size=LAY.block_bytes)
        f = PageFetcher(cache, LAY, torch.float32, PT, keys + lost, None)
        assert f.fetch_pages(0, [0, 4]) is None  # page 4 is in the block never stored
        assert f.fetch_pages(0, [7]) is None  # past the known blocks
        assert f.counters.failed_fetches == 1 and f.counters.pages_copied == 0
        assert f.fetch_pages(0, [1, 2]) is not None


class Down:
    """A cache whose service went away: every call raises."""

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise ConnectionError("service down")
        return call


def test_a_cache_that_raises_fails_the_fetch():
    keys, _ = chain(2, 5, size=LAY.block_bytes)
    f = PageFetcher(Down(), LAY, torch.float32, PT, keys, None)
    assert f.fetch_pages(1, [0]) is None
    assert f.counters.failed_fetches == 1
