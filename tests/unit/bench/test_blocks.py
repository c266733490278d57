"""ucm.bench.blocks: the key chain every bench and probe derives the same
way, the filler that pushes a hit below DRAM, and the tier counts."""
from ucm.bench.blocks import chain, push_below_dram, tier_counts


def test_a_chain_is_the_same_keys_for_the_same_seed():
    assert [k.hex() for k in chain(3, 7)] == ["e7b0ae0c67c1a4f52177875a9983a050", "da9b08beaa48c490a1b97248eb30f2a5",
                                              "ea606ed6f4fe9fc804fcef7a2044990c"]
    assert chain(2, 7) == chain(3, 7)[:2] and chain(2, 8) != chain(2, 7)


class _Done:
    def wait(self, timeout):
        return []


class TwoTiers:
    """`locate` says dram for the watched keys until `room` filler blocks went in."""

    def __init__(self, keys, room):
        self.keys, self.room, self.stored, self.flushes = set(keys), room, 0, 0

    def locate(self, keys):
        return ["nvme" if self.stored >= self.room else "dram" for _ in keys]

    def store(self, keys, bufs):
        self.stored += len(keys)
        return _Done()

    def flush(self):
        self.flushes += 1


def test_filler_goes_in_until_every_key_is_below_dram_then_the_cache_flushes():
    keys = chain(4, 1)
    cache = TwoTiers(keys, room=20)
    assert push_below_dram(cache, keys, 64, limit=10, per_round=8) == ["nvme"] * 4
    assert cache.stored == 24 and cache.flushes == 1  # whole rounds of 8, the third one enough


def test_filler_stops_after_limit_rounds():
    cache = TwoTiers(chain(2, 1), room=10**6)
    assert push_below_dram(cache, chain(2, 1), 64, limit=3, per_round=2) == ["dram", "dram"]
    assert cache.stored == 6


def test_tier_counts_name_a_missing_block_none():
    assert tier_counts(["dram", "nvme", None, "nvme"]) == {"dram": 1, "nvme": 2, "None": 1}
