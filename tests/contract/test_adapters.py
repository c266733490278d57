"""One suite over every adapter installed under the `ucm.adapters` entry points."""
import os
import threading

import pytest

from ucm.adapters.base import Status, adapter_names, load_adapter_class
from ucm.errors import ArgumentError

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

pytestmark = pytest.mark.parametrize("name", adapter_names())


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
        a.close()


def data(n, size=SIZE):
    return [os.urandom(size) for _ in range(n)]


def keys(n):
    return [os.urandom(16) for _ in range(n)]


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


def test_miss_delete_and_size_mismatch(name, make):
    a = make(name)
    k, d = keys(3), data(3)
    a.put(k, d)
    assert a.get([os.urandom(16)], [bytearray(SIZE)]) == [Status.NOT_FOUND]
    assert a.get([k[0]], [bytearray(SIZE - 1)]) == [Status.CORRUPT]
    assert a.delete([k[1], os.urandom(16)]) == [True, False]
    assert a.contains(k) == [True, False, True]
    assert a.get([k[1]], [bytearray(SIZE)]) == [Status.NOT_FOUND]


def test_a_key_keeps_its_first_blob(name, make):
    a = make(name)
    k = keys(1)
    first, second = data(2)
    assert a.put(k, [first]) == [Status.OK]
    assert a.put(k, [second]) == [Status.OK]
    out = bytearray(SIZE)
    a.get(k, [out])
    assert bytes(out) == first


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


def test_misuse_raises_typed_errors(name, make):
    a = make(name)
    with pytest.raises(ArgumentError):
        a.put(keys(2), data(1))
    with pytest.raises(ArgumentError):
        a.get(keys(1), [b"read-only bytes"])
