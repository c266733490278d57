"""FaultyAdapter over a SharedSlots tier (dram): the slot calls pass
through, and `raise_on` makes any of them raise, a given number of times."""
import os

import pytest

from ucm.adapters.dram import DramAdapter, DramConfig
from ucm.adapters.faults import FaultyAdapter

SIZE = 64 << 10


@pytest.fixture
def dram(tmp_path):
    a = FaultyAdapter(DramAdapter(4 * SIZE, DramConfig(path=str(tmp_path), prefault=False)))
    yield a
    a.close()


def committed(a, key):
    view = a.reserve(key, SIZE)
    view.release()
    assert a.commit(key)


@pytest.mark.parametrize("op", ["reserve", "commit", "abort", "lease"])
def test_a_slot_call_raises_as_often_as_told_then_runs(dram, op):
    key = os.urandom(16)
    if op in ("commit", "abort"):
        dram.reserve(key, SIZE).release()
    call = {"reserve": lambda: dram.reserve(key, SIZE), "commit": lambda: dram.commit(key),
            "abort": lambda: dram.abort(key), "lease": lambda: dram.lease(key)}[op]
    dram.raise_on(op, RuntimeError("injected"), times=1)
    with pytest.raises(RuntimeError, match="injected"):
        call()
    call()  # the rule is spent: the real call
    assert dram.calls[op] == 2


def test_a_release_that_raises_keeps_the_lease(dram):
    key = os.urandom(16)
    committed(dram, key)
    lease = dram.lease(key)
    dram.raise_on("release", RuntimeError("injected"), times=1)
    with pytest.raises(RuntimeError, match="injected"):
        dram.release(lease)
    used = dram.used_bytes
    assert dram.delete([key]) == [True] and dram.used_bytes == used  # still leased: not freed yet
    dram.release(lease)
    assert dram.used_bytes == used - dram.footprint_bytes(SIZE)
