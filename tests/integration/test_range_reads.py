"""Range reads (UnifiedCache.read_ranges, ucm/cache/ranges.py) over real
dram and nvme tiers: a block held only on NVMe is read range by range, the
medium reads only the verified chunks that cover the ranges, the block is
not staged, and a corrupted chunk is a CORRUPT block (forgotten), never
other bytes."""
import os

from test_layer_stream import LAYER, LAYERS, SIZE, cfg, on_nvme
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache


def _one_layer(layer):
    """Two small spans inside one layer of a block (as sparse decode reads a
    page's K and V of one head)."""
    return [layer * LAYER + 256, layer * LAYER + LAYER // 2], [bytearray(2048), bytearray(2048)]


def test_an_nvme_block_is_read_by_ranges_without_staging(nvme_dir):
    keys, data = on_nvme(nvme_dir, 3, 21)
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.locate(keys) == ["nvme"] * 3
        before = c.stats()["tiers"]["nvme"]["adapter"]["bytes_read"]
        offs, dsts = zip(*[_one_layer(2 + i) for i in range(3)])
        got = c.read_ranges(keys, offs, dsts)
        assert [(r.outcome, r.tier, r.bytes) for r in got] == [(Outcome.DONE, "nvme", 4096)] * 3
        for i in range(3):
            assert [bytes(d) for d in dsts[i]] == [data[i][o:o + 2048] for o in offs[i]]
        s = c.stats()
        medium = s["tiers"]["nvme"]["adapter"]["bytes_read"] - before
        assert 3 * 4096 <= medium < 3 * SIZE // 2  # the covering chunks, not the blocks (SIZE each)
        assert s["tiers"]["nvme"]["range_bytes"] == 3 * 4096 and s["range_blocks"] == 3
        assert c.locate(keys) == ["nvme"] * 3  # nothing staged
        # A block in DRAM is read out of its slot.
        full = [bytearray(SIZE)]
        assert c.load(keys[:1], full).wait(30) == [Outcome.DONE]
        assert c.locate(keys[:1]) == ["dram"]
        o, d = _one_layer(LAYERS - 1)
        r = c.read_ranges(keys[:1], [o], [d])[0]
        assert (r.outcome, r.tier, r.bytes) == (Outcome.DONE, "dram", 4096)
        assert [bytes(x) for x in d] == [data[0][x:x + 2048] for x in o]


def test_a_corrupted_chunk_under_a_range_is_corrupt_and_forgotten(nvme_dir):
    keys, data = on_nvme(nvme_dir, 2, 22)
    path = os.path.join(nvme_dir, "ucm-regions.dat")
    raw = open(path, "rb").read()
    pos = raw.find(data[1][3 * LAYER:3 * LAYER + 4096]) + 300
    assert pos > 300
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 1]))
    with UnifiedCache(cfg(nvme_dir)) as c:
        offs, dsts = zip(*[_one_layer(3), _one_layer(3)])
        got = c.read_ranges(keys, offs, dsts)
        assert got[0].outcome is Outcome.DONE and [bytes(d) for d in dsts[0]] == [data[0][o:o + 2048]
                                                                                   for o in offs[0]]
        assert got[1].outcome is Outcome.CORRUPT
        assert c.lookup(keys) == 1  # the bad copy is forgotten
        # A range elsewhere in a good block is still served.
        o, d = _one_layer(6)
        assert c.read_ranges(keys[:1], [o], [d])[0].outcome is Outcome.DONE


def test_ranges_closer_than_the_merge_gap_are_read_as_one_span():
    from ucm.cache.ranges import MERGE_GAP, merged_spans

    assert merged_spans([100, 0, 5000], [10, 50, 10]) == [(0, 5010, [1, 0, 2])]  # in offset order
    assert merged_spans([0, 10 * MERGE_GAP], [8, 8]) == [(0, 8, [0]), (10 * MERGE_GAP, 10 * MERGE_GAP + 8, [1])]
    assert merged_spans([0, 8], [8, 8], gap=0) == [(0, 8, [0]), (8, 16, [1])]  # touching, not merged
    assert merged_spans([0, 4], [8, 8], gap=0) == [(0, 12, [0, 1])]  # overlapping ranges share a span
    assert merged_spans([], []) == []
