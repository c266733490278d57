"""The PaddedReads ability (ucm/adapters/base.py) over every installed
adapter whose class declares it, with the contract suite's fixtures and
helpers (test_adapters.py)."""
import mmap
import os

import pytest

from test_adapters import MEDIUM_FILE, SIZE, _flip, data, declaring, each, keys, make  # noqa: F401  (make: a fixture)
from ucm.adapters.base import PaddedReads, Status
from ucm.errors import ArgumentError


def _padded(n, unit, offset=0):
    """A writable view of n bytes padded to `unit`, at `offset` bytes past a
    page boundary, pre-filled with 0xAA; and the mapping it lies in."""
    span = -(-n // unit) * unit
    m = mmap.mmap(-1, span + offset + mmap.PAGESIZE)
    m[:] = b"\xaa" * len(m)
    return memoryview(m)[offset:offset + span], m


@each(declaring(PaddedReads))
def test_get_padded_lands_the_blob_in_the_first_bytes(name, make):
    a = make(name)
    unit = a.read_unit
    assert unit >= 1
    k = keys(3)
    d = [os.urandom(SIZE), os.urandom(unit * 3), os.urandom(SIZE + 7)]  # not whole units, whole units, odd
    assert a.put(k, d) == [Status.OK] * 3
    miss = os.urandom(16)
    for when in ("as stored", "flushed"):  # a buffered medium serves the first from memory
        if when == "flushed":
            assert a.flush()
        for offset in (0, 8):  # aligned (read in place where the medium can), and not
            views = [_padded(len(b), unit, offset) for b in d] + [_padded(8, unit)]
            got = a.get_padded(k + [miss], [v for v, _ in views])
            assert got == [Status.OK] * 3 + [Status.NOT_FOUND], (when, offset)
            for b, (v, _) in zip(d, views):
                assert bytes(v[:len(b)]) == b, (when, offset)
            assert bytes(views[-1][0]) == b"\xaa" * len(views[-1][0])  # a miss leaves the destination alone
            for v, m in views:
                v.release()
                m.close()
        # Exactly the blob's length is a padded read too; shorter, or past its rounded size, is CORRUPT.
        exact = bytearray(SIZE)
        assert a.get_padded([k[0]], [exact]) == [Status.OK] and exact == d[0]
        over = -(-SIZE // unit) * unit + 1
        assert a.get_padded([k[0], k[0]], [bytearray(SIZE - 1), bytearray(over)]) == [Status.CORRUPT] * 2, when
    with pytest.raises(ArgumentError):
        a.get_padded(k[:2], [bytearray(SIZE)])


@each([n for n in declaring(PaddedReads) if n in MEDIUM_FILE])
def test_a_corrupted_byte_in_a_padded_read_is_corrupt(name, make):
    a = make(name)
    k, d = keys(1)[0], data(1)[0]
    assert a.put([k], [d]) == [Status.OK] and a.flush()
    _flip(MEDIUM_FILE[name](a, k), d, SIZE - 3)
    v, m = _padded(SIZE, a.read_unit)
    assert a.get_padded([k], [v]) == [Status.CORRUPT]
    v.release()
    m.close()
    assert a.get([k], [bytearray(SIZE)])[0] in (Status.CORRUPT, Status.NOT_FOUND)
