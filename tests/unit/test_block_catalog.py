"""The block catalog (ucm.cache.catalog): descriptions, the sweep against
the cache's `locate`, the journal readers page through, and its bounds."""
import pytest

from ucm.api import check_blocks
from ucm.cache.catalog import BlockCatalog
from ucm.errors import ArgumentError

MEDIA = {"dram": "CPU_TIER1", "nvme": "DISK"}


def key(i):
    return i.to_bytes(16, "little")


def block(i, parent=None, extra=None):
    return (key(i), None if parent is None else key(parent), bytes(range(8)), extra)


class Where:
    """A cache's `locate`: tiers set by the test."""

    def __init__(self):
        self.tier = {}

    def __call__(self, keys):
        return [self.tier.get(k) for k in keys]


def kinds(page):
    return [(e[1], int.from_bytes(e[2], "little"), e[3]) for e in page["events"]]


def test_a_described_block_is_journaled_as_it_enters_moves_and_leaves():
    where = Where()
    cat = BlockCatalog(where, MEDIA, min_sweep_s=0, sweep_share=1.0)
    cat.describe([block(1), block(2, 1)])
    first = cat.events(0, None)
    assert first["reset"] and first["events"] == []  # a new reader starts from the holdings
    epoch, nxt = first["epoch"], first["next"]
    assert cat.events(nxt, epoch)["events"] == []  # described, not held: nothing to tell
    where.tier.update({key(1): "dram", key(2): "dram"})
    page = cat.events(nxt, epoch)
    assert kinds(page) == [("stored", 1, "CPU_TIER1"), ("stored", 2, "CPU_TIER1")]
    row = page["events"][1]
    assert row[4] == key(1) and row[5] == bytes(range(8)) and row[6] is None  # parent, tokens, extra
    where.tier[key(2)] = "nvme"
    page2 = cat.events(page["next"], epoch)
    assert kinds(page2) == [("stored", 2, "DISK")]
    del where.tier[key(1)], where.tier[key(2)]
    page3 = cat.events(page2["next"], epoch)
    assert kinds(page3) == [("removed", 1, "CPU_TIER1"), ("removed", 2, "DISK")]
    assert page3["events"][0][4:] == [None, None, None]
    assert cat.stats()["blocks"] == 0  # a removed block's description is gone with it


def test_a_reader_of_another_epoch_or_too_far_behind_is_told_to_reset():
    where = Where()
    cat = BlockCatalog(where, MEDIA, journal=16, min_sweep_s=0, sweep_share=1.0)
    epoch = cat.events(0, None)["epoch"]
    assert cat.events(0, epoch ^ 1)["reset"]
    for i in range(40):  # 40 changes: more than the journal keeps
        cat.describe([block(i)])
        where.tier[key(i)] = "dram"
        cat.sweep(force=True)
    assert cat.events(0, epoch)["reset"]
    assert not cat.events(30, epoch)["reset"]
    assert cat.events(10 ** 6, epoch)["reset"]  # a position the journal never had
    held, offset = [], 0
    while True:
        h = cat.holdings(offset, 7)
        held += [int.from_bytes(r[2], "little") for r in h["blocks"]]
        offset = h["next_offset"]
        if h["done"]:
            break
    assert held == list(range(40))


def test_paging_through_the_journal_loses_nothing():
    where = Where()
    cat = BlockCatalog(where, MEDIA, min_sweep_s=0, sweep_share=1.0)
    first = cat.events(0, None)
    cat.describe([block(i) for i in range(10)])
    where.tier.update({key(i): "dram" for i in range(10)})
    got, nxt = [], first["next"]
    while True:
        page = cat.events(nxt, first["epoch"], limit=3)
        got += [int.from_bytes(e[2], "little") for e in page["events"]]
        if not page["events"]:
            break
        nxt = page["next"]
    assert got == list(range(10))


def test_bounds_the_oldest_description_goes_and_a_store_that_never_landed_is_forgotten():
    where = Where()
    cat = BlockCatalog(where, MEDIA, max_blocks=2, min_sweep_s=0, sweep_share=1.0, pending_s=0.0)
    e = cat.events(0, None)
    cat.describe([block(1)])
    where.tier[key(1)] = "dram"
    cat.sweep(force=True)
    cat.describe([block(2), block(3)])  # block 1 (held) is forgotten: journaled as removed
    page = cat.events(e["next"], e["epoch"])
    assert ("removed", 1, "CPU_TIER1") in kinds(page)
    cat.sweep(force=True)  # blocks 2 and 3 never showed up in a tier and pending_s is 0
    assert cat.stats()["blocks"] == 0 and cat.stats()["forgotten"] == 3


def test_a_tier_without_a_medium_is_not_advertised():
    where = Where()
    cat = BlockCatalog(where, {"nvme": "DISK"}, min_sweep_s=0, sweep_share=1.0)
    e = cat.events(0, None)
    cat.describe([block(1)])
    where.tier[key(1)] = "dram"
    assert cat.events(e["next"], e["epoch"])["events"] == []
    where.tier[key(1)] = "nvme"
    assert kinds(cat.events(e["next"], e["epoch"])) == [("stored", 1, "DISK")]


@pytest.mark.parametrize("bad, what", [
    ("x", "list"),
    ([(b"k", None, b"1234", None)], "key must be 16 bytes"),
    ([(key(1), b"p", b"1234", None)], "parent must be 16 bytes"),
    ([(key(1), None, b"123", None)], "uint32"),
    ([(key(1), None, b"", None)], "uint32"),
    ([(key(1), None, b"1234", {"seed": "x"})], "cache_salt"),
    ([(key(1), None, b"1234", {"cache_salt": 5})], "cache_salt"),
])
def test_bad_descriptions_get_a_typed_error_naming_the_field(bad, what):
    with pytest.raises(ArgumentError, match=what):
        check_blocks(bad)


def test_sweeps_keep_to_their_share_of_a_core_however_often_readers_ask():
    import time

    class SlowWhere(Where):
        def __call__(self, keys):
            time.sleep(0.02)  # a large catalog's locate
            return super().__call__(keys)

    where = SlowWhere()
    cat = BlockCatalog(where, MEDIA, min_sweep_s=0, sweep_share=0.05)
    e = cat.events(0, None)
    cat.describe([block(1)])
    where.tier[key(1)] = "dram"
    cat.sweep(force=True)  # a 20 ms sweep: the next may run only 380 ms after it
    before = cat.stats()["sweeps"]
    for _ in range(5):  # readers asking again at once
        assert kinds(cat.events(e["next"], e["epoch"])) == [("stored", 1, "CPU_TIER1")]
    assert cat.stats()["sweeps"] == before
    cat.sweep(force=True)
    assert cat.stats()["sweeps"] == before + 1
