"""nvme recovery: large sparse media, the footer format and its version, the
parents the footer carries, and the prefix tree UnifiedCache rebuilds."""
import os
import struct

import pytest

from ucm import _native
from ucm.adapters.nvme import recovery as nvme_recovery
from ucm.adapters.nvme import format as fmt
from ucm.adapters.base import BlockEntry, Status
from ucm.adapters.nvme import FILE_NAME, NvmeAdapter, NvmeConfig
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.errors import ArgumentError

RS = 64 << 10


def config(path, **kw):
    return NvmeConfig(path=str(path), region_size=RS, io_chunk=RS, **kw)


CHUNK = 8192


def entry(key, parent, off, data, chunk=CHUNK):
    csum, chunks = fmt.block_checksums(data, chunk)
    return fmt.FooterEntry(key, parent, off, len(data), csum, chunk, chunks)


def encode_v2_footer(blocks, seq, region, rs):
    """A version-2 footer of (key, parent, offset, bytes), written out by
    hand: 64-byte entries (key, parent, offset, length, XXH3-64 of the
    block, flags) and the same trailer as version 3 with magic UCMREGN2."""
    n = len(blocks)
    size = fmt.align_up(n * 64 + 64)
    foot = bytearray(size)
    for i, (key, parent, off, data) in enumerate(blocks):
        foot[i * 64:(i + 1) * 64] = struct.pack("<16s16sQQQQ", key, parent or bytes(16), off, len(data),
                                                _native.checksum(data), 1 if parent else 0)
    head = b"UCMREGN2" + struct.pack("<QQQQQQ", seq, n, size, _native.checksum(bytes(foot[:n * 64])), region, rs)
    foot[-64:] = head + struct.pack("<Q", _native.checksum(head))
    return bytes(foot)


def write_region(path, region, blocks, seq, rs=RS, version=3):
    """Writes a sealed region by hand: each (key, parent, bytes) at the next
    4 KiB-aligned offset, then its footer (version 2 or 3)."""
    entries, off = [], 0
    with open(path, "r+b") as f:
        for key, parent, data in blocks:
            f.seek(region * rs + off)
            f.write(data)
            entries.append(entry(key, parent, off, data))
            off += fmt.align_up(len(data))
        if version == 3:
            foot = fmt.encode_footer(entries, seq=seq, region=region, region_size=rs)
        else:
            foot = encode_v2_footer([(e.key, e.parent, e.offset, data) for e, (_, _, data) in zip(entries, blocks)],
                                    seq, region, rs)
        assert off + len(foot) <= rs
        f.seek((region + 1) * rs - len(foot))
        f.write(foot)


def read_back(a, keys, sizes):
    out = [bytearray(n) for n in sizes]
    return a.get(keys, out), [bytes(o) for o in out]


def test_recovers_a_sparse_medium_of_100k_regions(tmp_path):
    n = 100_000
    cap = n * RS
    keys = [os.urandom(16) for _ in range(30)]
    data = [os.urandom(1000 + 211 * i) for i in range(30)]
    parents = [None] + keys[:-1]
    a = NvmeAdapter(cap, config(tmp_path))
    assert a.put(keys[:20], data[:20], parents[:20]) == [Status.OK] * 20  # low regions
    assert a.flush()
    a.close()
    path = tmp_path / FILE_NAME
    os.truncate(path, cap)  # the rest of the medium: holes, read as zeros (never sealed)
    write_region(path, 50_000, list(zip(keys[20:25], parents[20:25], data[20:25])), seq=1000)
    write_region(path, n - 1, list(zip(keys[25:], parents[25:], data[25:])), seq=1001)

    b = NvmeAdapter(cap, config(tmp_path))
    try:
        assert b.stats()["recovered_blocks"] == 30
        assert sorted(b.iter_entries()) == sorted(BlockEntry(k, len(d), p) for k, d, p in zip(keys, data, parents))
        statuses, out = read_back(b, keys, [len(d) for d in data])
        assert statuses == [Status.OK] * 30
        assert out == data
        # regions holding blocks are not handed out again; the next put goes to a free one
        k, d = os.urandom(16), os.urandom(9000)
        assert b.put([k], [d]) == [Status.OK]
        assert b.flush()
    finally:
        b.close()
    c = NvmeAdapter(cap, config(tmp_path))
    try:
        statuses, out = read_back(c, keys + [k], [len(x) for x in data] + [len(d)])
        assert statuses == [Status.OK] * 31 and out == data + [d]
    finally:
        c.close()


def test_footers_longer_than_a_page_are_read_in_batches(tmp_path, monkeypatch):
    # 64 entries of 72 bytes, their chunk tables and the trailer need two pages of footer. Small
    # batches (a tuning constant, not behaviour) so that several are needed.
    monkeypatch.setattr(nvme_recovery, "_TRAILER_BATCH", 7)
    monkeypatch.setattr(nvme_recovery, "_FOOTER_BATCH_BYTES", 3 * fmt.ALIGN)
    rs = 512 << 10
    cap = 40 * rs
    conf = NvmeConfig(path=str(tmp_path), region_size=rs, io_chunk=rs)
    NvmeAdapter(cap, conf).close()
    os.truncate(tmp_path / FILE_NAME, cap)
    blocks = {r: [(os.urandom(16), None, os.urandom(1 + (r * 7 + i) % 400)) for i in range(64 + r % 5)]
              for r in range(0, 40, 3)}
    for r, bl in blocks.items():
        write_region(tmp_path / FILE_NAME, r, bl, seq=r + 1, rs=rs)
    assert fmt.footer_bytes(64) == 2 * fmt.ALIGN
    b = NvmeAdapter(cap, conf)
    try:
        flat = [blk for bl in blocks.values() for blk in bl]
        assert b.stats()["recovered_blocks"] == len(flat)
        statuses, out = read_back(b, [k for k, _, _ in flat], [len(d) for _, _, d in flat])
        assert statuses == [Status.OK] * len(flat)
        assert out == [d for _, _, d in flat]
    finally:
        b.close()


def test_newest_copy_of_a_key_wins(tmp_path):
    cap = 8 * RS
    NvmeAdapter(cap, config(tmp_path)).close()
    os.truncate(tmp_path / FILE_NAME, cap)
    key, old_parent, new_parent = os.urandom(16), os.urandom(16), os.urandom(16)
    data = os.urandom(3000)
    write_region(tmp_path / FILE_NAME, 5, [(key, new_parent, data)], seq=9)
    write_region(tmp_path / FILE_NAME, 2, [(key, old_parent, data)], seq=4)
    a = NvmeAdapter(cap, config(tmp_path))
    try:
        assert list(a.iter_entries()) == [BlockEntry(key, 3000, new_parent)]
    finally:
        a.close()


# The version-1 layout, written out by hand: 48-byte entries (key, offset,
# length, checksum) and a 56-byte trailer ending 8 bytes before the region's end.
V1_MAGIC = b"UCMREGN1"


def write_v1_region(path, region, key, data):
    entry = key + struct.pack("<QQQ", 0, len(data), _native.checksum(data))
    foot = bytearray(fmt.ALIGN)
    foot[:48] = entry
    head = V1_MAGIC + struct.pack("<QQQQQ", 7, 1, fmt.ALIGN, _native.checksum(bytes(entry)), region)
    foot[fmt.ALIGN - 64:fmt.ALIGN - 8] = head + struct.pack("<Q", _native.checksum(head))
    with open(path, "r+b") as f:
        f.seek(region * RS)
        f.write(data)
        f.seek((region + 1) * RS - fmt.ALIGN)
        f.write(bytes(foot))


def test_a_version_1_region_is_another_format_and_counts_as_empty(tmp_path):
    cap = 4 * RS
    NvmeAdapter(cap, config(tmp_path)).close()
    os.truncate(tmp_path / FILE_NAME, cap)
    old_key = os.urandom(16)
    write_v1_region(tmp_path / FILE_NAME, 0, old_key, os.urandom(2000))
    with open(tmp_path / FILE_NAME, "rb") as f:
        f.seek(RS - fmt.ALIGN)
        tail = f.read(fmt.ALIGN)
    assert fmt.decode_trailer(memoryview(tail), 0, RS) is fmt.Refused.OTHER_FORMAT
    a = NvmeAdapter(cap, config(tmp_path))
    try:
        assert list(a.iter_keys()) == []
        assert a.stats()["free_regions"] == 4
        k, d = os.urandom(16), os.urandom(7000)
        assert a.put([k], [d]) == [Status.OK] and a.flush()  # reuses region 0, invalidating the old trailer
    finally:
        a.close()
    b = NvmeAdapter(cap, config(tmp_path))
    try:
        assert list(b.iter_keys()) == [k]
        assert read_back(b, [k], [len(d)]) == ([Status.OK], [d])
    finally:
        b.close()


def test_footer_layout_is_version_3():
    key, parent = bytes(range(16)), bytes(range(16, 32))
    d1, d2 = bytes(range(256)) * 20 + bytes(120), b"\x07" * 4096  # 5240 bytes: two 4 KiB chunks; one chunk
    e1 = entry(key, parent, 8192, d1, chunk=4096)
    e2 = entry(parent, None, 0, d2, chunk=4096)
    assert e1.chunks == _native.checksum(d1[:4096]).to_bytes(8, "little") + _native.checksum(d1[4096:]).to_bytes(
        8, "little")
    assert e1.checksum == _native.checksum(e1.chunks)
    foot = fmt.encode_footer([e1, e2], seq=3, region=9, region_size=RS)
    assert len(foot) == fmt.ALIGN == fmt.footer_bytes(2, 3)
    assert foot[:72] == (key + parent + bytes.fromhex("0020000000000000" "7814000000000000")
                         + e1.checksum.to_bytes(8, "little") + bytes.fromhex("0100000000000000" "0010000000000000"))
    assert foot[72:144] == parent + bytes(16) + bytes.fromhex("0000000000000000" "0010000000000000") + (
        e2.checksum.to_bytes(8, "little") + bytes.fromhex("0000000000000000" "0010000000000000"))
    assert foot[144:168] == e1.chunks + e2.chunks  # the chunk tables, entry by entry
    assert foot[168:-64] == bytes(len(foot) - 168 - 64)
    trailer = foot[-64:]
    assert trailer[:8] == b"UCMREGN3"
    assert struct.unpack("<QQQQ", trailer[8:40]) == (3, 2, 4096, _native.checksum(foot[:144]))
    assert struct.unpack("<QQ", trailer[40:56]) == (9, RS)
    t = fmt.decode_trailer(memoryview(foot), 9, RS)
    assert t == fmt.Trailer(3, 2, 4096, t.entries_checksum, 9, RS, 3)
    assert fmt.decode_entries(memoryview(foot), t) == (e1, e2)
    # the same bytes read as another region, or with another region size, are refused
    assert fmt.decode_trailer(memoryview(foot), 8, RS) is fmt.Refused.BAD_TRAILER
    assert fmt.decode_trailer(memoryview(foot), 9, 2 * RS) is fmt.Refused.BAD_TRAILER
    assert fmt.decode_trailer(memoryview(bytes(4096)), 9, RS) is fmt.Refused.EMPTY


def test_footer_layout_of_version_2_is_still_decoded():
    key, parent = bytes(range(16)), bytes(range(16, 32))
    d1, d2 = os.urandom(5000), os.urandom(4096)
    foot = encode_v2_footer([(key, parent, 8192, d1), (parent, None, 0, d2)], seq=3, region=9, rs=RS)
    t = fmt.decode_trailer(memoryview(foot), 9, RS)
    assert t == fmt.Trailer(3, 2, 4096, t.entries_checksum, 9, RS, 2)
    assert fmt.decode_entries(memoryview(foot), t) == (
        fmt.FooterEntry(key, parent, 8192, 5000, _native.checksum(d1)),
        fmt.FooterEntry(parent, None, 0, 4096, _native.checksum(d2)))


def _refuses(entries, rs=RS, edit=None):
    foot = bytearray(fmt.encode_footer(entries, seq=1, region=0, region_size=rs))
    if edit:
        edit(foot)
    t = fmt.decode_trailer(memoryview(foot), 0, rs)
    return t if isinstance(t, fmt.Refused) else fmt.decode_entries(memoryview(foot), t)


def test_overlapping_entries_refuse_the_region():
    k1, k2 = os.urandom(16), os.urandom(16)
    assert _refuses([entry(k1, None, 0, os.urandom(5000)), entry(k2, None, 4096, os.urandom(10))]) \
        is fmt.Refused.BAD_ENTRY


def test_a_chunk_table_that_does_not_match_its_entry_refuses_the_region():
    k1, k2 = os.urandom(16), os.urandom(16)
    good = [entry(k1, None, 0, os.urandom(20_000)), entry(k2, None, 20_480, os.urandom(100))]
    assert isinstance(_refuses(good), tuple)

    def flip_table(foot):  # a chunk checksum changed, the entries' checksum still right
        foot[2 * fmt.ENTRY.size + 3] ^= 1
    assert _refuses(good, edit=flip_table) is fmt.Refused.BAD_ENTRY
    # a chunk size that is no multiple of 4 KiB, or a table that claims more bytes than the footer has
    bad_size = [good[0]._replace(chunk_bytes=1000, chunks=_native.chunk_checksums(bytes(20_000), 1000))]
    bad_size[0] = bad_size[0]._replace(checksum=_native.checksum(bad_size[0].chunks))
    assert _refuses(bad_size) is fmt.Refused.BAD_ENTRY

    def more_entries(foot):  # a trailer that says 3 entries: the third one's table runs past the footer
        n_off = len(foot) - 64 + 16
        foot[n_off:n_off + 8] = (3).to_bytes(8, "little")
    assert isinstance(_refuses(good, edit=more_entries), fmt.Refused)
    with pytest.raises(ArgumentError, match="needs a chunk size"):
        fmt.encode_footer([good[0]._replace(chunks=b"")], seq=1, region=0, region_size=RS)


def test_a_version_2_region_is_still_read_and_its_ranges_are_verified_whole(tmp_path):
    cap = 8 * RS
    NvmeAdapter(cap, config(tmp_path)).close()
    os.truncate(tmp_path / FILE_NAME, cap)
    keys = [os.urandom(16) for _ in range(3)]
    data = [os.urandom(9000), os.urandom(20_000), os.urandom(4096)]
    write_region(tmp_path / FILE_NAME, 4, list(zip(keys, [None] + keys[:2], data)), seq=5, version=2)
    a = NvmeAdapter(cap, config(tmp_path))
    try:
        assert sorted(a.iter_entries()) == sorted(BlockEntry(k, len(d), p)
                                                  for k, d, p in zip(keys, data, [None] + keys[:2]))
        assert read_back(a, keys, [len(d) for d in data]) == ([Status.OK] * 3, data)
        before = a.stats()["bytes_read"]
        out = bytearray(100)
        assert a.get_range([keys[1]], [15_000], [out]) == [Status.OK] and out == data[1][15_000:15_100]
        assert a.stats()["bytes_read"] - before == 20_000  # no chunk table: the whole block, verified
    finally:
        a.close()
    corrupt(tmp_path / FILE_NAME, data[1])  # a byte far from the range read next
    b = NvmeAdapter(cap, config(tmp_path))
    try:
        assert b.get_range([keys[1]], [15_000], [bytearray(100)]) == [Status.CORRUPT]
        assert b.contains([keys[1]]) == [False] and b.drain_dropped() == [keys[1]]
    finally:
        b.close()


def test_reclaiming_a_version_2_region_gives_its_blocks_chunk_tables(tmp_path):
    rs, cap = RS, 3 * RS
    conf = NvmeConfig(path=str(tmp_path), region_size=rs, io_chunk=rs, write_buffers=1, chunk_bytes=8192)
    NvmeAdapter(cap, conf).close()
    os.truncate(tmp_path / FILE_NAME, cap)
    old = {os.urandom(16): os.urandom(20_000) for _ in range(2)}
    filler = {os.urandom(16): os.urandom(20_000) for _ in range(6)}
    write_region(tmp_path / FILE_NAME, 0, [(k, None, d) for k, d in old.items()], seq=1, rs=rs, version=2)
    a = NvmeAdapter(cap, conf)
    try:
        for k, d in filler.items():  # regions 1 and 2 fill; the next put reclaims region 0 (fewest live bytes)
            assert a.put([k], [d]) == [Status.OK]
        new = {os.urandom(16): os.urandom(20_000)}
        assert a.put(list(new), list(new.values())) == [Status.OK]
        assert a.stats()["regions_reclaimed"] >= 1 and a.stats()["reinserted"] >= 2
        assert a.flush()
    finally:
        a.close()
    with open(tmp_path / FILE_NAME, "rb") as f:
        f.seek(rs - fmt.ALIGN)
        t = fmt.decode_trailer(memoryview(f.read(fmt.ALIGN)), 0, rs)
    assert t.version == 3
    b = NvmeAdapter(cap, conf)
    try:
        for k, d in old.items():
            out = bytearray(5000)
            assert b.get_range([k], [9000], [out]) == [Status.OK] and out == d[9000:14_000]
        before = b.stats()["bytes_read"]
        k, d = next(iter(old.items()))
        assert b.get_range([k], [9000], [bytearray(5000)]) == [Status.OK]
        assert b.stats()["bytes_read"] - before == 8192  # one 8 KiB chunk covers [9000, 14000)
    finally:
        b.close()


def test_put_checks_parents(tmp_path):
    with NvmeAdapter(4 * RS, config(tmp_path)) as a:
        with pytest.raises(Exception, match="2 keys but 1 parents"):
            a.put([os.urandom(16)] * 2, [b"x" * 10] * 2, [None])
        with pytest.raises(Exception, match="parent must be None or 16 bytes"):
            a.put([os.urandom(16)], [b"x" * 10], [b"short"])


def cache_config(path):
    return {"tiers": [{"adapter": "nvme", "capacity": f"{16 * RS}",
                       "options": {"path": str(path), "region_size": f"{RS}", "io_chunk": f"{RS}"}}],
            "landing_tier": "nvme", "policy": {"name": "lru"}}


def corrupt(path, data):
    raw = open(path, "rb").read()
    pos = raw.find(data[:4096]) + 100
    assert pos > 100
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 1]))


def test_restart_keeps_the_prefix_tree(tmp_path):
    keys = [os.urandom(16) for _ in range(6)]
    data = [os.urandom(6000) for _ in range(6)]
    with UnifiedCache(cache_config(tmp_path)) as c:
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 6
        assert c.flush()
    corrupt(tmp_path / FILE_NAME, data[2])
    with UnifiedCache(cache_config(tmp_path)) as c:
        out = [bytearray(6000) for _ in keys]
        res = c.load(keys, out).wait(30)
        assert res[:3] == [Outcome.DONE, Outcome.DONE, Outcome.CORRUPT]
        # the bad block's descendants went with it: they are useless without their prefix
        assert c.locate(keys) == ["nvme", "nvme", None, None, None, None]


def test_restart_orders_parents_first_and_keeps_orphans_as_roots(tmp_path):
    keys = [os.urandom(16) for _ in range(5)]
    data = [os.urandom(6000) for _ in range(5)]
    orphan, orphan_data = os.urandom(16), os.urandom(6000)
    a = NvmeAdapter(16 * RS, config(tmp_path))
    # children before their parents, each in its own region: the footers list them deepest first
    for i in reversed(range(5)):
        assert a.put_with_parents([keys[i]], [data[i]], [keys[i - 1] if i else None]) == [Status.OK]
        assert a.flush()
    assert a.put_with_parents([orphan], [orphan_data], [os.urandom(16)]) == [Status.OK]  # its parent is nowhere
    a.close()
    corrupt(tmp_path / FILE_NAME, data[0])
    with UnifiedCache(cache_config(tmp_path)) as c:
        assert c.locate(keys + [orphan]) == ["nvme"] * 6
        out = bytearray(6000)
        assert c.load([orphan], [out]).wait(30) == [Outcome.DONE] and bytes(out) == orphan_data
        assert c.load([keys[0]], [bytearray(6000)]).wait(30) == [Outcome.CORRUPT]
        assert c.locate(keys + [orphan]) == [None] * 5 + ["nvme"]
