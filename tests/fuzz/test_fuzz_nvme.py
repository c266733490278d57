"""Fuzz nvme recovery: random bytes and mutated footers on a real region file.

Whatever is on the medium, opening it never raises (a clean start), and every
block served afterwards, by the adapter or by a UnifiedCache over it, has the
bytes first written under its key, or is a miss. Seeded (tests/fuzz/fuzzing.py):
UCM_FUZZ_SEED and UCM_FUZZ_EXAMPLES replay a failure or run longer by hand."""
import functools
import os
import tempfile

from fuzzing import SEED, examples, mutate as mutate_bytes, rng
from ucm import _native
from ucm.adapters.nvme import format as fmt
from ucm.adapters.base import Status
from ucm.adapters.nvme import FILE_NAME, NvmeAdapter, NvmeConfig
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.config.schema import load_config

RS = 512 << 10
N_REGIONS = 8
CAP = N_REGIONS * RS


def config(path):
    return NvmeConfig(path=path, region_size=RS, io_chunk=128 << 10)


@functools.lru_cache(maxsize=1)
def medium() -> tuple[bytes, dict[bytes, bytes]]:
    """A medium written by the adapter: region 0 with 100 small blocks (a
    two-page footer), the others with larger blocks in chains."""
    rnd = __import__("random").Random(7)
    expect: dict[bytes, bytes] = {}
    with tempfile.TemporaryDirectory() as d:
        a = NvmeAdapter(CAP, config(d))
        parent = None
        for i in range(100 + 40):
            key = rnd.randbytes(16)
            data = rnd.randbytes(rnd.randint(1, 3000) if i < 100 else rnd.randint(10_000, 60_000))
            assert a.put([key], [data], [parent]) == [Status.OK]
            expect[key] = data
            parent = key if i % 10 else None
        assert a.flush()
        a.close()
        with open(os.path.join(d, FILE_NAME), "rb") as f:
            raw = f.read()
    assert len(raw) >= 4 * RS
    return raw, expect


def footer_of(raw: bytearray, region: int):
    tail = memoryview(raw)[(region + 1) * RS - 64 * fmt.ALIGN:(region + 1) * RS]
    t = fmt.decode_trailer(tail, region, RS)
    if isinstance(t, fmt.Refused):
        return None
    entries = fmt.decode_entries(tail, t)
    return None if isinstance(entries, fmt.Refused) else (t, list(entries))


U64_EDGES = [0, 1, fmt.ALIGN, RS - fmt.ALIGN, RS, 2 ** 63, 2 ** 64 - 1]
FIELDS = ["offset", "length", "parent", "parent_cycle", "seq", "drop", "dup"]


def u64(rnd):
    r = rnd.random()
    if r < 0.3:
        return rnd.choice(U64_EDGES)
    if r < 0.7:
        return rnd.randrange(65) * fmt.ALIGN
    return rnd.getrandbits(64)


def draw_mutation(rnd):
    kind = rnd.choice(("bytes", "bytes", "flip", "flip", "edit", "copy_footer", "truncate", "refield", "refield"))
    region = rnd.randrange(N_REGIONS)
    if kind == "bytes":
        return kind, rnd.randrange(CAP), rnd.randbytes(rnd.randrange(1, 4097))
    if kind == "flip":
        return kind, region, rnd.randrange(1, 2 * fmt.ALIGN + 1), rnd.randrange(8)
    if kind == "edit":  # the shared byte mutator over a region's last two pages
        return kind, region, rnd.getrandbits(32)
    if kind == "copy_footer":
        return kind, region, rnd.randrange(N_REGIONS)
    if kind == "truncate":
        return kind, rnd.randrange(CAP + 1)
    # a footer re-encoded with a field changed: checksums valid, meaning garbage
    return kind, region, rnd.choice(FIELDS), rnd.randrange(200), u64(rnd)


def mutate(raw: bytearray, m) -> bytearray:
    kind = m[0]
    if kind == "bytes":
        _, off, data = m
        raw[off:off + len(data)] = data[:max(0, len(raw) - off)]
    elif kind == "flip":
        _, region, back, bit = m
        pos = (region + 1) * RS - back
        if 0 <= pos < len(raw):
            raw[pos] ^= 1 << bit
    elif kind == "copy_footer":
        _, src, dst = m
        if (max(src, dst) + 1) * RS <= len(raw):
            raw[(dst + 1) * RS - 2 * fmt.ALIGN:(dst + 1) * RS] = raw[(src + 1) * RS - 2 * fmt.ALIGN:(src + 1) * RS]
    elif kind == "truncate":
        del raw[m[1]:]
    elif kind == "edit":
        _, region, seed = m
        lo, hi = (region + 1) * RS - 2 * fmt.ALIGN, (region + 1) * RS
        if hi <= len(raw):
            edited = mutate_bytes(__import__("random").Random(seed), bytes(raw[lo:hi]))
            raw[lo:hi] = edited[:hi - lo].ljust(hi - lo, b"\0")  # edits stay in place: the region keeps its size
    else:
        _, region, what, i, value = m
        if (region + 1) * RS > len(raw):
            return raw
        found = footer_of(raw, region)
        if found is None or not found[1]:
            return raw
        t, entries = found
        i %= len(entries)
        e = entries[i]
        seq = t.seq
        if what == "offset":
            entries[i] = e._replace(offset=value)
        elif what == "length":  # a chunk table of the new length's size, whose checksum the entry records
            size = fmt.n_chunks(value, e.chunk_bytes) * fmt.CHUNK_SUM if e.chunk_bytes else 0
            if not e.chunk_bytes or size > RS:
                return raw
            chunks = (e.chunks + bytes(size))[:size]
            entries[i] = e._replace(length=value, chunks=chunks, checksum=_native.checksum(chunks))
        elif what == "parent":
            entries[i] = e._replace(parent=value.to_bytes(8, "little") * 2)
        elif what == "parent_cycle":  # e's parent becomes a block whose ancestor is e
            j = (i + 1 + value) % len(entries)
            entries[i] = e._replace(parent=entries[j].key)
            entries[j] = entries[j]._replace(parent=e.key)
        elif what == "seq":
            seq = value
        elif what == "drop":
            del entries[i]
        else:
            entries.append(e)
        if any(not e.chunk_bytes for e in entries):  # a version-2 footer is not re-encoded
            return raw
        foot = fmt.encode_footer(entries, seq=seq, region=region, region_size=RS)
        if len(foot) > RS:
            return raw
        raw[(region + 1) * RS - len(foot):(region + 1) * RS] = foot
    return raw


def check_adapter(d: str, expect: dict[bytes, bytes]) -> None:
    a = NvmeAdapter(CAP, config(d))
    try:
        entries = list(a.iter_entries())
        assert {e.key for e in entries} <= set(expect)  # no key comes from nowhere
        for e in entries:
            out = bytearray(e.size_bytes)
            st_ = a.get([e.key], [out])[0]
            assert st_ in (Status.OK, Status.CORRUPT, Status.FAILED, Status.NOT_FOUND)
            if st_ is Status.OK:
                assert bytes(out) == expect[e.key]
        # the medium is usable after a clean start: new blocks go in and come back
        fresh = {os.urandom(16): os.urandom(n) for n in (5000, 70_000, 200_000)}
        assert a.put(list(fresh), list(fresh.values())) == [Status.OK] * 3
        assert a.flush()
    finally:
        a.close()
    b = NvmeAdapter(CAP, config(d))
    try:
        for key, data in fresh.items():
            out = bytearray(len(data))
            assert b.get([key], [out]) == [Status.OK] and out == data
    finally:
        b.close()


def check_cache(d: str, expect: dict[bytes, bytes]) -> None:
    conf = {"tiers": [{"adapter": "nvme", "capacity": CAP,
                       "options": {"path": d, "region_size": RS, "io_chunk": 128 << 10}}],
            "landing_tier": "nvme", "policy": {"name": "lru"}}
    # environ={}: UCM_FUZZ_* would otherwise be read as config overrides
    with UnifiedCache(load_config(conf, environ={})) as c:
        keys = list(expect)
        outs = [bytearray(len(expect[k])) for k in keys]
        res = c.load(keys, outs).wait(60)
        for k, o, r in zip(keys, outs, res):
            assert r in (Outcome.DONE, Outcome.MISSING, Outcome.CORRUPT, Outcome.FAILED)
            if r is Outcome.DONE:
                assert bytes(o) == expect[k]


def test_recovery_from_a_mutated_medium_serves_only_the_bytes_written():
    raw, expect = medium()
    rnd = rng("nvme_medium")
    for n in range(examples(25)):
        mutations = [draw_mutation(rnd) for _ in range(rnd.randint(1, 4))]
        buf = bytearray(raw)
        for m in mutations:
            buf = mutate(buf, m)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, FILE_NAME), "wb") as f:
                f.write(buf)
            try:
                check_cache(d, expect)
                check_adapter(d, expect)
            except BaseException as exc:
                raise AssertionError(f"UCMFUZZ_SEED={SEED} example {n}: mutations "
                                     f"{[m[:2] + m[3:4] for m in mutations]}: {exc!r}") from exc


def test_decoding_a_random_trailer_returns_a_refusal():
    rnd = rng("nvme_trailer")
    for _ in range(examples(2000)):
        data = rnd.randbytes(rnd.randrange(64, 2 * fmt.ALIGN))
        if rnd.random() < 0.5:  # our magic in front of random fields
            data = data[:-64] + fmt.MAGIC.to_bytes(8, "little") + data[-56:]
        t = fmt.decode_trailer(memoryview(data), rnd.randrange(4), RS)
        assert isinstance(t, fmt.Refused)  # a trailer needs its checksum: random bytes never pass


def test_garbage_version_2_entries_behind_a_valid_trailer_are_refused_or_in_bounds():
    rnd = rng("nvme_entries")
    es = fmt.ENTRY_V2.size
    for _ in range(examples(2000)):
        region, checksummed = rnd.randrange(4), rnd.random() < 0.8
        n = rnd.randrange(0, 41)
        raw = bytearray(rnd.randbytes(n * es))
        for i in range(n):  # plausible fields often enough to get past the first check
            if rnd.random() < 0.7:
                raw[i * es + 56:i * es + 64] = rnd.choice((0, 0, 1, 2)).to_bytes(8, "little")  # flags
                if raw[i * es + 56] == 0:
                    raw[i * es + 16:i * es + 32] = bytes(16)
                raw[i * es + 32:i * es + 40] = (rnd.randrange(16) * fmt.ALIGN).to_bytes(8, "little")
                raw[i * es + 40:i * es + 48] = rnd.randrange(1, 3 * fmt.ALIGN).to_bytes(8, "little")
        size = fmt.align_up(n * es + fmt.TRAILER_BYTES)
        buf = bytearray(size)
        buf[:len(raw)] = raw
        ecsum = _native.checksum(bytes(raw)) if checksummed else 12345
        head = fmt.TRAILER.pack(fmt.MAGIC_V2, 5, n, size, ecsum, region, RS, 0)[:-8]
        buf[-64:] = head + _native.checksum(head).to_bytes(8, "little")
        t = fmt.decode_trailer(memoryview(buf), region, RS)
        assert t == fmt.Trailer(5, n, size, ecsum, region, RS, 2)
        entries = fmt.decode_entries(memoryview(buf), t)
        if not checksummed:
            assert entries is fmt.Refused.BAD_ENTRIES
        elif not isinstance(entries, fmt.Refused):
            assert len(entries) == n
            ends = sorted((e.offset, e.offset + fmt.align_up(e.length)) for e in entries)
            for e in entries:
                assert e.offset % fmt.ALIGN == 0 and 0 < e.length and e.offset + e.length <= RS - size
                assert e.chunk_bytes == 0 and e.chunks == b""
            assert all(b[0] >= a[1] for a, b in zip(ends, ends[1:]))


def test_garbage_version_3_entries_and_chunk_tables_are_refused_or_consistent():
    rnd = rng("nvme_entries_v3")
    es = fmt.ENTRY.size
    for _ in range(examples(2000)):
        region, checksummed = rnd.randrange(4), rnd.random() < 0.8
        n = rnd.randrange(0, 41)
        raw = bytearray(rnd.randbytes(n * es))
        tables = bytearray()
        for i in range(n):  # plausible fields, and tables whose checksum matches, often enough
            if rnd.random() < 0.7:
                raw[i * es + 56:i * es + 64] = rnd.choice((0, 0, 1, 2)).to_bytes(8, "little")  # flags
                if raw[i * es + 56] == 0:
                    raw[i * es + 16:i * es + 32] = bytes(16)
                raw[i * es + 32:i * es + 40] = (rnd.randrange(16) * fmt.ALIGN).to_bytes(8, "little")
                length = rnd.randrange(1, 3 * fmt.ALIGN)
                raw[i * es + 40:i * es + 48] = length.to_bytes(8, "little")
                chunk = rnd.choice((4096, 8192, 4096, 1000, 0, RS, 2 * RS))
                raw[i * es + 64:i * es + 72] = chunk.to_bytes(8, "little")
                m = fmt.n_chunks(length, chunk) + rnd.choice((0, 0, 0, 1, -1)) if chunk else rnd.randrange(3)
                table = rnd.randbytes(max(0, m) * fmt.CHUNK_SUM)
                if rnd.random() < 0.8:
                    raw[i * es + 48:i * es + 56] = _native.checksum(table).to_bytes(8, "little")
                tables += table
        size = fmt.align_up(n * es + len(tables) + fmt.TRAILER_BYTES)
        if size > RS:
            continue
        buf = bytearray(size)
        buf[:len(raw)] = raw
        buf[len(raw):len(raw) + len(tables)] = tables
        ecsum = _native.checksum(bytes(raw)) if checksummed else 12345
        head = fmt.TRAILER.pack(fmt.MAGIC, 5, n, size, ecsum, region, RS, 0)[:-8]
        buf[-64:] = head + _native.checksum(head).to_bytes(8, "little")
        t = fmt.decode_trailer(memoryview(buf), region, RS)
        assert t == fmt.Trailer(5, n, size, ecsum, region, RS, 3)
        entries = fmt.decode_entries(memoryview(buf), t)
        if not checksummed:
            assert entries is fmt.Refused.BAD_ENTRIES
        elif not isinstance(entries, fmt.Refused):
            assert len(entries) == n
            ends = sorted((e.offset, e.offset + fmt.align_up(e.length)) for e in entries)
            for e in entries:
                assert e.offset % fmt.ALIGN == 0 and 0 < e.length and e.offset + e.length <= RS - size
                assert e.chunk_bytes % fmt.ALIGN == 0 and 0 < e.chunk_bytes <= RS
                assert len(e.chunks) == fmt.n_chunks(e.length, e.chunk_bytes) * fmt.CHUNK_SUM
                assert _native.checksum(e.chunks) == e.checksum
            assert all(b[0] >= a[1] for a, b in zip(ends, ends[1:]))
            assert sum(len(e.chunks) for e in entries) == len(tables)
