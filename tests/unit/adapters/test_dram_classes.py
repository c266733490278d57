"""DramAdapter with two block sizes: units of its arena move between size
classes, and `victims_for` names what to evict when a size finds no slot."""
import os

import pytest

from ucm.adapters.base import Status
from ucm.adapters.dram import DramAdapter, DramConfig, SlotVictims
from ucm.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
A, B = 64 * KiB, 96 * KiB  # two models' block sizes


@pytest.fixture
def dram(tmp_path):
    a = DramAdapter(1 * MiB, DramConfig(path=str(tmp_path), prefault=False))  # 8 extents of 128 KiB
    yield a
    a.close()


def blob(size, seed):
    return (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]


def fill(dram, n, size, seed=0):
    keys = [os.urandom(16) for _ in range(n)]
    assert dram.put(keys, [blob(size, seed + i) for i in range(n)]) == [Status.OK] * n
    return keys


def test_a_second_size_gets_an_extent_once_one_is_empty(dram):
    a = fill(dram, 16, A)
    assert dram.used_bytes == dram.capacity_bytes and dram.stats()["extents_free"] == 0
    kb = os.urandom(16)
    assert dram.put([kb], [blob(B, 99)]) == [Status.NO_SPACE]
    dram.delete(a[6:8])  # the two blocks of extent 3
    assert dram.stats()["extents_free"] == 1
    assert dram.put([kb], [blob(B, 99)]) == [Status.OK]
    assert dram.slot_offset(kb) == (3 * 128 * KiB, B)
    out = bytearray(B)
    assert dram.get([kb], [out]) == [Status.OK] and out == blob(B, 99)
    assert dram.footprint_bytes(B) == 128 * KiB and dram.footprint_bytes(A) == A  # a slot's share of its extent
    dram.delete([kb])
    assert dram.stats()["extents_free"] == 1 and dram.used_bytes == 14 * A


def test_victims_are_the_cheapest_extent_of_another_class(dram):
    a = fill(dram, 16, A)
    dram.delete([a[4], a[11]])  # extents 2 and 5 keep one block each
    v = dram.victims_for(B)
    assert not v.any_one and v.keys == (a[5],)
    dram.delete(list(v.keys))
    assert dram.reserve(os.urandom(16), B) is not None


def test_victims_skip_leased_and_reserved_slots(dram):
    a = fill(dram, 16, A)
    dram.delete([a[4]])
    pending = os.urandom(16)
    assert dram.reserve(pending, A) is not None  # a writer takes the free slot of extent 2
    dram.delete([a[11]])
    assert dram.victims_for(B).keys == (a[10],)
    lease = dram.lease(a[10])  # a reader holds extent 5
    v = dram.victims_for(B)  # nothing partly free is left to release: a whole extent goes
    assert not v.any_one and set(v.keys) == {a[0], a[1]}
    dram.release(lease)
    dram.abort(pending)
    assert dram.victims_for(B).keys == (a[5],)  # extent 2 is releasable again, with one block


def test_a_full_class_evicts_within_itself(dram):
    b = fill(dram, 8, B)  # one per extent: the arena is full of the second size
    v = dram.victims_for(B)
    assert v.any_one and set(v.keys) == set(b)
    lease = dram.lease(b[0])
    assert set(dram.victims_for(B).keys) == set(b[1:])
    dram.release(lease)
    # A size with no extent of its own must empty one whole extent.
    v = dram.victims_for(A)
    assert not v.any_one and v.keys == (b[0],)


def test_a_slot_larger_than_an_extent_needs_a_run(dram):
    a = fill(dram, 16, A)
    dram.delete([a[2], a[9]])  # extents 1 and 4 keep one block each
    v = dram.victims_for(200 * KiB)  # two contiguous extents: the cheapest window is 0-1 (3 blocks)
    assert not v.any_one and set(v.keys) == {a[0], a[1], a[3]}
    dram.delete(list(v.keys))
    k = os.urandom(16)
    assert dram.put([k], [blob(200 * KiB, 7)]) == [Status.OK] and dram.slot_offset(k) == (0, 200 * KiB)


def test_extent_bytes_is_validated(tmp_path):
    assert DramConfig(extent_bytes="1MiB").extent_bytes == MiB
    with pytest.raises((ConfigError, ValueError), match="multiple of 4096"):
        DramConfig(extent_bytes=5000)


def test_victims_respect_the_owners_judgement(dram):
    a = fill(dram, 16, A)
    dram.delete([a[4], a[11]])  # extents 2 and 5 keep one block each
    assert dram.victims_for(B, lambda keys: a[5] not in keys).keys == (a[10],)
    v = dram.victims_for(B, lambda keys: a[5] not in keys and a[10] not in keys)
    assert set(v.keys) == {a[0], a[1]}
    assert dram.victims_for(B, lambda keys: False).keys == ()
    dram.delete([a[5]])
    b = fill(dram, 1, B, seed=50)[0]  # takes the emptied extent 2
    lease = dram.lease(a[10])
    assert dram.victims_for(B) == SlotVictims((b,), any_one=True)
    v = dram.victims_for(B, lambda keys: keys != (b,))  # its own block refused: a whole extent is emptied
    assert not v.any_one and set(v.keys) == {a[0], a[1]}
    dram.release(lease)
