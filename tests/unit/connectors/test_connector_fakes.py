"""The connector tests' fake cache (connector_fakes.py) answers as the real
one does where the connector does not exercise it."""
from connector_fakes import FakeCache
from ucm.api import Outcome, RangeRead


def test_the_fakes_range_reads_answer_as_the_cache_does():
    """The connector reads no ranges; the fake has them to be a CacheAPI, and
    they answer as UnifiedCache's do: the bytes, CORRUPT past the block,
    MISSING for a lost block."""
    c = FakeCache()
    k1, k2 = b"a" * 16, b"b" * 16
    blob = bytes(range(256)) * 4

    def fill(first, slots, arena):
        for off, n in slots:
            arena[off:off + n] = blob[:n]

    assert c.write_slots([k1, k2], [1024, 1024], fill) == [Outcome.DONE] * 2
    c.lost.add(k2)
    a, b, over = bytearray(10), bytearray(3), bytearray(2)
    got = c.read_ranges([k1, k1, k2], [[5, 1000], [1023], [0]], [[a, b], [over], [bytearray(4)]])
    assert got[0] == RangeRead(Outcome.DONE, "dram", 13) and bytes(a) == blob[5:15] and bytes(b) == blob[1000:1003]
    assert got[1].outcome is Outcome.CORRUPT and over == bytearray(2)
    assert got[2].outcome is Outcome.MISSING
