"""One suite over every adapter installed under the `ucm.adapters` entry points:
the base contract for all of them, and each optional ability (ucm.adapters.base)
for every adapter whose class declares it."""
import mmap
import os
import threading

import pytest

from ucm.adapters.base import (RangeReads, SharedSlots, SlotVictims, Status, adapter_names, load_adapter_class,
                               read_range)
from ucm.errors import ArgumentError, ClosedError

CAP = 8 << 20
SIZE = 100_000

# Options an adapter needs in a test sandbox (a directory, a small region).
def _server(var):
    """A server address from the session fixture (tests/contract/conftest.py), or a skip."""
    value = os.environ.get(var)
    if not value:
        pytest.skip(f"{var} is not set: no server for this adapter here")
    return value


NEEDS = {
    "nvme": lambda tmp: {"path": str(tmp), "region_size": "1MiB", "io_chunk": "256KiB"},
    "fs": lambda tmp: {"path": str(tmp)},
    "redis": lambda tmp: {"url": _server("UCMTEST_REDIS_URL"), "key_prefix": f"contract/{tmp.name}/"},
    "mooncake": lambda tmp: {"master": _server("UCMTEST_MOONCAKE_MASTER"), "segment_size": "32MiB",
                             "local_buffer_size": "16MiB", "key_prefix": f"contract/{tmp.name}/"},
}

ALL = adapter_names()


def declaring(ability):
    """The installed adapters whose class declares `ability`."""
    return [n for n in ALL if issubclass(load_adapter_class(n), ability)]


def each(names, known=None):
    """`name` parametrized over `names`; `known` maps a name to the reason of
    a known failure of that adapter (a strict xfail: it must still fail)."""
    known = known or {}
    return pytest.mark.parametrize("name", [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=known[n])) if n in known else n
        for n in names])


every_adapter = each(ALL)


@pytest.fixture
def make(tmp_path):
    made = []

    def build(name, capacity=CAP):
        cls = load_adapter_class(name)
        opts = NEEDS.get(name, lambda tmp: {})(tmp_path)
        a = cls(capacity_bytes=capacity, config=cls.Config(**opts))
        made.append(a)
        return a

    yield build
    for a in made:
        a.close()  # a second close (after a test closed it) is a no-op


def data(n, size=SIZE):
    return [os.urandom(size) for _ in range(n)]


def keys(n):
    return [os.urandom(16) for _ in range(n)]


@every_adapter
def test_round_trip(name, make):
    a = make(name)
    k, d = keys(10), data(10)
    assert a.put(k, d) == [Status.OK] * 10
    assert a.contains(k) == [True] * 10
    out = [bytearray(SIZE) for _ in k]
    assert a.get(k, out) == [Status.OK] * 10
    assert [bytes(o) for o in out] == d
    assert sorted(a.iter_keys()) == sorted(k)
    assert a.size_of(k[0]) == SIZE and a.size_of(os.urandom(16)) is None


@every_adapter
def test_miss_delete_and_size_mismatch(name, make):
    a = make(name)
    k, d = keys(3), data(3)
    a.put(k, d)
    assert a.get([os.urandom(16)], [bytearray(SIZE)]) == [Status.NOT_FOUND]
    assert a.get([k[0]], [bytearray(SIZE - 1)]) == [Status.CORRUPT]
    assert a.delete([k[1], os.urandom(16)]) == [True, False]
    assert a.contains(k) == [True, False, True]
    assert a.get([k[1]], [bytearray(SIZE)]) == [Status.NOT_FOUND]


@every_adapter
def test_a_key_keeps_its_first_blob(name, make):
    a = make(name)
    k = keys(1)
    first, second = data(2)
    assert a.put(k, [first]) == [Status.OK]
    assert a.put(k, [second]) == [Status.OK]
    out = bytearray(SIZE)
    a.get(k, [out])
    assert bytes(out) == first


@every_adapter
def test_overfill_keeps_capacity_and_never_returns_wrong_bytes(name, make):
    a = make(name)
    k, d = keys(200), data(200)
    for i in range(0, 200, 20):
        a.put(k[i:i + 20], d[i:i + 20])
    assert a.used_bytes <= CAP
    present = [x for x, c in zip(k, a.contains(k)) if c]
    assert present, "an overfilled tier still holds blocks"
    expect = dict(zip(k, d))
    out = [bytearray(SIZE) for _ in present]
    st = a.get(present, out)
    for key, s, o in zip(present, st, out):
        assert s is Status.OK and bytes(o) == expect[key]


@every_adapter
def test_threads(name, make):
    a = make(name)
    errors = []

    def work(seed):
        try:
            k, d = keys(5), data(5)
            assert a.put(k, d) == [Status.OK] * 5
            out = [bytearray(SIZE) for _ in k]
            st = a.get(k, out)
            for s, o, x in zip(st, out, d):
                assert s is Status.OK and bytes(o) == x
        except BaseException as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


@every_adapter
def test_misuse_raises_typed_errors(name, make):
    a = make(name)
    with pytest.raises(ArgumentError):
        a.put(keys(2), data(1))
    with pytest.raises(ArgumentError):
        a.get(keys(1), [b"read-only bytes"])


# ---- the rest of the base contract ------------------------------------------
@every_adapter
def test_use_after_close_raises_closed_error(name, make):
    a = make(name)
    k, d = keys(1), data(1)
    assert a.put(k, d) == [Status.OK]
    a.close()
    a.close()
    with pytest.raises(ClosedError):
        a.put(keys(1), data(1))
    with pytest.raises(ClosedError):
        a.get(k, [bytearray(SIZE)])


@every_adapter
def test_empty_batches_answer_empty_lists(name, make):
    a = make(name)
    assert a.put([], []) == []
    assert a.get([], []) == []
    assert a.contains([]) == []
    assert a.delete([]) == []
    assert read_range(a, [], [], []) == []


SMALL, LARGE = SIZE, 3 * SIZE + 123  # two block sizes (two size classes of a slab arena)


@every_adapter
def test_a_block_costs_its_footprint(name, make):
    """What the cache counts per block (footprint_bytes) is what used_bytes adds."""
    a = make(name)
    before = a.used_bytes
    for size in (SMALL, LARGE):
        assert a.footprint_bytes(size) >= size
        k = keys(1)
        assert a.put(k, [os.urandom(size)]) == [Status.OK]
        assert a.used_bytes == before + a.footprint_bytes(size)
        assert a.delete(k) == [True] and a.used_bytes == before


@every_adapter
def test_delete_gives_the_bytes_back(name, make):
    a = make(name)
    before = a.used_bytes
    k = keys(4)
    assert a.put(k, data(4)) == [Status.OK] * 4 and a.used_bytes > before
    assert a.delete(k[:2]) == [True, True] and a.delete(k[:2]) == [False, False]
    assert a.delete(k[2:]) == [True, True] and a.used_bytes == before


@every_adapter
def test_concurrent_puts_of_one_key_keep_one_copy(name, make):
    a = make(name)
    first = keys(1)  # what one block of SIZE adds to used_bytes, measured on a key of its own
    before = a.used_bytes
    assert a.put(first, data(1)) == [Status.OK]
    one = a.used_bytes - before
    assert a.delete(first) == [True]
    key = os.urandom(16)
    blobs = data(6)
    start = threading.Barrier(len(blobs))
    results, errors = {}, []

    def work(i):
        try:
            start.wait()
            results[i] = a.put([key], [blobs[i]])
        except BaseException as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(blobs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert all(r == [Status.OK] for r in results.values()) and len(results) == len(blobs)
    assert list(a.iter_keys()) == [key]
    assert a.used_bytes == before + one
    out = bytearray(SIZE)
    assert a.get([key], [out]) == [Status.OK] and bytes(out) in blobs
    assert a.delete([key]) == [True] and a.used_bytes == before


@every_adapter
def test_two_block_sizes_in_one_adapter(name, make):
    a = make(name)
    before = a.used_bytes
    ks = keys(8)
    blobs = [os.urandom(SMALL if i % 2 else LARGE) for i in range(8)]
    assert a.put(ks, blobs) == [Status.OK] * 8
    assert [a.size_of(k) for k in ks] == [len(b) for b in blobs]
    out = [bytearray(len(b)) for b in blobs]
    assert a.get(ks, out) == [Status.OK] * 8 and [bytes(o) for o in out] == blobs
    assert a.get([ks[0]], [bytearray(SMALL)]) == [Status.CORRUPT]  # a large block is not read as a small one
    assert a.delete(ks[::2]) == [True] * 4  # the large ones
    assert a.get(ks[1::2], out[1::2]) == [Status.OK] * 4 and [bytes(o) for o in out[1::2]] == blobs[1::2]
    assert a.delete(ks[1::2]) == [True] * 4 and a.used_bytes == before


@every_adapter
def test_a_batch_may_name_a_key_twice(name, make):
    a = make(name)
    k, d = keys(1), data(1)
    assert a.put(k + k, d + d) == [Status.OK] * 2
    out = [bytearray(SIZE), bytearray(SIZE)]
    assert a.get(k + k, out) == [Status.OK] * 2 and out == [d[0]] * 2
    assert a.contains(k + k) == [True] * 2
    assert a.delete(k + k) == [True, False]


# ---- RangeReads (and read_range, its fallback for every adapter) -----------
# Ranges of a SIZE-byte blob: first and last byte, ranges crossing the 32 KiB
# and 64 KiB chunk boundaries of nvme and fs, exactly one chunk, the short
# last chunk, the whole blob, and empty ranges (OK anywhere inside the blob,
# offset == SIZE included: they read nothing).
RANGES = [(0, 1), (SIZE - 1, 1), (32_760, 20), (65_536 - 5, 10), (32_768, 32_768), (98_304, SIZE - 98_304),
          (1000, 500), (SIZE - 10, 10), (0, SIZE), (0, 0), (50_000, 0), (SIZE, 0), (31_000, 40_000)]


def _check_ranges(a, reader):
    k, d = keys(1)[0], data(1)[0]
    assert a.put([k], [d]) == [Status.OK]
    miss = os.urandom(16)
    for when in ("as stored", "flushed"):  # a buffered medium serves the first from memory
        if when == "flushed":
            assert a.flush()
        offsets = [o for o, _ in RANGES] + [0]
        dsts = [bytearray(n) for _, n in RANGES] + [bytearray(4)]
        assert reader([k] * len(RANGES) + [miss], offsets, dsts) == [Status.OK] * len(RANGES) + [Status.NOT_FOUND], when
        assert [bytes(x) for x in dsts[:-1]] == [d[o:o + n] for o, n in RANGES], when
        assert dsts[-1] == bytearray(4)  # a miss leaves the destination alone
        # A range that does not lie inside the blob.
        assert reader([k, k, k], [SIZE - 5, SIZE + 1, 0], [bytearray(10), bytearray(0), bytearray(SIZE + 1)]) == [
            Status.CORRUPT] * 3, when
    with pytest.raises(ArgumentError):
        reader([k, k], [0], [bytearray(1), bytearray(1)])
    with pytest.raises(ArgumentError):
        reader([k], [-1], [bytearray(1)])
    with pytest.raises(ArgumentError):
        reader([k], [0], [b"read-only"])


@each(declaring(RangeReads))
def test_get_range_reads_a_slice_of_a_blob(name, make):
    a = make(name)
    assert isinstance(a, RangeReads)
    _check_ranges(a, a.get_range)


@every_adapter
def test_read_range_works_with_any_adapter(name, make):
    a = make(name)
    _check_ranges(a, lambda ks, offs, dsts: read_range(a, ks, offs, dsts))


# Where a block's bytes lie on the medium, for the adapters that keep them in files.
MEDIUM_FILE = {
    "nvme": lambda a, key: a.stats()["path"],
    "fs": lambda a, key: a.path_of(key),
}


def _flip(path, blob, offset):
    """Flips one bit of the stored copy of `blob` at `offset` in its file."""
    with open(path, "r+b") as f:
        raw = f.read()
        at = raw.find(blob)
        assert at >= 0 and raw.find(blob, at + 1) < 0
        f.seek(at + offset)
        f.write(bytes([raw[at + offset] ^ 0x10]))


@each([n for n in declaring(RangeReads) if n in MEDIUM_FILE])
def test_a_corrupted_byte_in_a_range_is_corrupt_never_wrong_bytes(name, make):
    a = make(name)
    k, d = keys(1)[0], data(1)[0]
    assert a.put([k], [d]) == [Status.OK] and a.flush()
    bad = 70_000  # in the third 32 KiB chunk, the second 64 KiB one
    _flip(MEDIUM_FILE[name](a, k), d, bad)
    # Chunks are verified one by one: a range away from the bad one still verifies.
    out = bytearray(1000)
    assert a.get_range([k], [100], [out]) == [Status.OK] and out == d[100:1100]
    out = bytearray(b"\xaa" * 20)
    assert a.get_range([k], [bad - 10], [out]) == [Status.CORRUPT]
    assert out == bytearray(b"\xaa" * 20)  # never the bytes read
    assert a.stats()["corrupt"] == 1
    # The whole block is never OK again: it is dropped (nvme) or CORRUPT, so the owner forgets it.
    assert a.get([k], [bytearray(SIZE)])[0] in (Status.CORRUPT, Status.NOT_FOUND)
    assert a.get_range([k], [0], [bytearray(SIZE)])[0] in (Status.CORRUPT, Status.NOT_FOUND)


# ---- SharedSlots ---------------------------------------------------------------
shared_slot_adapters = each(declaring(SharedSlots))


def _segment_bytes(a, offset, length):
    """What another process that maps the segment file sees there."""
    with open(a.segment_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return bytes(m[offset:offset + length])


@shared_slot_adapters
def test_a_reserved_key_is_invisible_until_commit(name, make):
    a = make(name)
    assert isinstance(a, SharedSlots)
    k, d = keys(1)[0], data(1)[0]
    view = a.reserve(k, SIZE)
    assert view is not None and len(view) == SIZE and not view.readonly
    view[:] = d
    assert a.contains([k]) == [False] and a.size_of(k) is None and list(a.iter_keys()) == []
    assert a.get([k], [bytearray(SIZE)]) == [Status.NOT_FOUND] and a.lease(k) is None
    assert a.reserve(k, SIZE) is None  # the writer keeps its slot
    assert a.put([k], data(1)) == [Status.OK]  # and a put leaves it alone
    offset, length = a.slot_offset(k)
    assert length == SIZE
    view.release()
    assert a.commit(k) is True and a.commit(k) is False
    out = bytearray(SIZE)
    assert a.get([k], [out]) == [Status.OK] and out == d
    assert a.slot_offset(k) == (offset, length) and _segment_bytes(a, offset, length) == d
    a.abort(k)  # nothing to abort: the committed blob stays
    assert a.contains([k]) == [True]


@shared_slot_adapters
def test_abort_gives_the_slot_back(name, make):
    a = make(name)
    before = a.used_bytes
    k = keys(1)[0]
    view = a.reserve(k, SIZE)
    assert a.used_bytes == before + a.footprint_bytes(SIZE)
    view.release()
    a.abort(k)
    assert a.used_bytes == before and a.slot_offset(k) is None
    assert a.commit(k) is False and a.contains([k]) == [False]
    a.abort(k)


@shared_slot_adapters
def test_a_lease_keeps_its_bytes_through_delete_and_refill(name, make):
    a = make(name)
    before = a.used_bytes
    k, d = keys(1)[0], data(1)[0]
    a.put([k], [d])
    lease = a.lease(k)
    assert (lease.key, lease.offset, lease.length) == (k, *a.slot_offset(k)) and lease.length == SIZE
    assert bytes(lease.view) == d
    assert a.delete([k]) == [True] and a.contains([k]) == [False] and a.lease(k) is None
    assert a.used_bytes == before + a.footprint_bytes(SIZE)  # the leased slot is not free yet
    while a.put(keys(1), data(1)) == [Status.OK]:  # refill the arena: no writer may take the slot
        pass
    assert bytes(lease.view) == d and _segment_bytes(a, lease.offset, lease.length) == d
    filled = a.used_bytes
    a.release(lease)
    assert a.used_bytes == filled - a.footprint_bytes(SIZE)  # freed with its last lease
    assert a.put(keys(1), data(1)) == [Status.OK]


@shared_slot_adapters
def test_segment_file_and_victims_of_an_empty_arena(name, make):
    a = make(name)
    assert os.path.getsize(a.segment_path) >= a.capacity_bytes
    assert a.slot_offset(os.urandom(16)) is None
    assert a.victims_for(SIZE) == SlotVictims((), any_one=False)
    a.close()
    with pytest.raises(ClosedError):
        a.reserve(os.urandom(16), SIZE)
    with pytest.raises(ClosedError):
        a.lease(os.urandom(16))
    with pytest.raises(ClosedError):
        a.victims_for(SIZE)
