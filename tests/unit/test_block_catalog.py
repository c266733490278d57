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


# ---- descriptions kept across restarts (ucm.cache.catalog_log) ------------------

def logged_catalog(path, where, **kw):
    from ucm.cache.catalog_log import DescriptionLog
    return BlockCatalog(where, MEDIA, min_sweep_s=0, sweep_share=1.0, log=DescriptionLog.open(str(path)), **kw)


def test_a_new_catalog_advertises_the_logged_blocks_a_tier_kept_and_forgets_the_rest(tmp_path):
    path = tmp_path / "events" / "catalog.log"  # its directory is created
    where = Where()
    cat = logged_catalog(path, where)
    cat.describe([block(1), block(2, 1, {"lora_name": "a"}), block(3, 2)])
    cat.describe([block(1)])  # described before: not logged twice
    assert cat.stats()["logged"] == 3
    cat.close()
    where.tier.update({key(1): "nvme", key(2): "nvme"})  # after the restart the tier kept 1 and 2
    again = logged_catalog(path, where, pending_s=0.0)
    assert again.stats()["restored"] == 3 and again.stats()["described"] == 0
    assert again.events(0, None)["reset"]  # a new instance: its readers start from the holdings
    page = again.holdings(0)
    assert [(r[1], int.from_bytes(r[2], "little"), r[3]) for r in page["blocks"]] == [
        ("stored", 1, "DISK"), ("stored", 2, "DISK")]
    assert page["blocks"][1][4:] == [key(1), bytes(range(8)), {"lora_name": "a"}]  # parent, tokens, extra
    assert again.stats()["blocks"] == 2  # block 3 is gone from every tier: forgotten, never claimed
    again.close()


def test_without_a_tier_holding_them_logged_blocks_are_never_claimed(tmp_path):
    where = Where()
    cat = logged_catalog(tmp_path / "c.log", where)
    cat.describe([block(i) for i in range(5)])
    cat.close()
    again = logged_catalog(tmp_path / "c.log", Where(), pending_s=0.0)
    e = again.events(0, None)
    assert again.events(e["next"], e["epoch"])["events"] == []
    assert again.holdings(0)["blocks"] == [] and again.stats()["blocks"] == 0
    again.close()


def test_a_torn_or_corrupt_tail_is_cut_and_the_records_before_it_are_kept(tmp_path, caplog):
    from ucm.cache.catalog_log import DescriptionLog
    path = str(tmp_path / "c.log")
    lg = DescriptionLog(path)
    lg.append([block(1), block(2, 1)])
    size_two = len(open(path, "rb").read())
    lg.append([block(3, 2)])
    lg.close()
    data = bytearray(open(path, "rb").read())
    data[size_two + 12] ^= 0xFF  # a flipped byte inside the third record
    open(path, "wb").write(bytes(data) + b"\x07" * 5)  # and a torn write after it
    lg = DescriptionLog(path)
    assert [b[0] for b in lg.load()] == [key(1), key(2)]
    assert "not whole records; cut off" in caplog.text
    assert len(open(path, "rb").read()) == size_two  # the file ends after the last good record
    lg.append([block(4)])  # appends go on from there
    lg.close()
    lg = DescriptionLog(path)
    assert [b[0] for b in lg.load()] == [key(1), key(2), key(4)] and lg.records == 3
    lg.close()


def test_the_largest_valid_description_reads_back_and_so_do_the_records_after_it(tmp_path):
    from ucm.api import EXTRA_FIELDS, MAX_BLOCK_TOKENS
    from ucm.cache.catalog_log import DescriptionLog
    path = str(tmp_path / "c.log")
    big = (key(1), key(0), b"\x01\x00\x00\x00" * MAX_BLOCK_TOKENS, {f: "\U0001F600" * 4096 for f in EXTRA_FIELDS})
    lg = DescriptionLog(path)
    lg.append(check_blocks([big]) + [block(2, 1)])
    lg.close()
    lg = DescriptionLog(path)
    got = lg.load()
    assert [b[0] for b in got] == [key(1), key(2)] and got[0][3] == big[3]
    lg.close()


def test_a_record_that_is_no_description_ends_the_log(tmp_path):
    import struct
    import zlib

    from ucm.cache.catalog_log import DescriptionLog
    path = str(tmp_path / "c.log")
    lg = DescriptionLog(path)
    lg.append([block(1)])
    lg.close()
    payload = key(2) + b"\x00" + struct.pack("<I", 3) + b"abc"  # 3 bytes of tokens: not uint32s
    with open(path, "ab") as f:
        f.write(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    lg = DescriptionLog(path)
    assert [b[0] for b in lg.load()] == [key(1)]
    lg.close()


def test_a_second_holder_of_the_log_keeps_its_descriptions_in_memory(tmp_path, caplog):
    from ucm.cache.catalog_log import DescriptionLog
    first = DescriptionLog.open(str(tmp_path / "c.log"))
    assert first is not None
    assert DescriptionLog.open(str(tmp_path / "c.log")) is None
    assert "in use by another process" in caplog.text
    first.close()
    assert DescriptionLog.open(str(tmp_path / "c.log")) is not None  # free again once closed


def test_the_log_is_rewritten_from_the_catalog_once_it_holds_far_more(tmp_path, monkeypatch):
    import ucm.cache.catalog as catalog
    monkeypatch.setattr(catalog, "COMPACT_SLACK", 0)
    where = Where()
    cat = logged_catalog(tmp_path / "c.log", where, max_blocks=3)
    for i in range(10):
        cat.describe([block(i)])
    assert cat.stats()["logged"] == 10
    where.tier.update({key(i): "dram" for i in range(10)})
    cat.sweep(force=True)  # 10 records for 3 descriptions: rewritten
    assert cat.stats()["logged"] == 3
    cat.describe([block(10)])  # appended to the new file
    where.tier[key(10)] = "dram"
    cat.close()
    again = logged_catalog(tmp_path / "c.log", where, max_blocks=3)
    again.sweep(force=True)
    assert [int.from_bytes(r[2], "little") for r in again.holdings(0)["blocks"]] == [8, 9, 10]
    again.close()


def test_a_log_that_fails_turns_itself_off_and_the_catalog_goes_on(tmp_path, monkeypatch, caplog):
    import errno
    import os

    import ucm.cache.catalog_log as catalog_log
    where = Where()
    cat = logged_catalog(tmp_path / "c.log", where)
    e = cat.events(0, None)
    cat.describe([block(1)])

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(catalog_log.os, "write", full)
    cat.describe([block(2, 1)])  # no exception into the describer
    monkeypatch.setattr(catalog_log.os, "write", os.write)
    assert "kept in memory only from now on" in caplog.text and cat.stats()["logged"] is None
    cat.describe([block(3, 2)])
    where.tier.update({key(i): "dram" for i in (1, 2, 3)})
    assert [k[1] for k in kinds(cat.events(e["next"], e["epoch"]))] == [1, 2, 3]
    cat.close()
    again = logged_catalog(tmp_path / "c.log", where)  # what was written before the fault
    assert again.stats()["restored"] == 1
    again.close()
