"""ClusterBudget: the index and byte count a cluster tier keeps of what it
stored in a shared medium (reserve, settle, gone, forget, learn, evict)."""
import pytest

from ucm.adapters import framing
from ucm.adapters.base import Status
from ucm.adapters.cluster import ClusterBudget
from ucm.errors import ArgumentError

H = framing.HEADER_BYTES
A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def test_a_put_reserves_then_settles_what_landed_and_releases_the_rest():
    b = ClusterBudget("t", 3 * (H + 100))
    res = b.reserve([A, B, C, D], [100] * 4)
    assert res.out == [None, None, None, Status.NO_SPACE] and res.todo == [0, 1, 2]
    assert b.used_bytes == 3 * (H + 100)  # reservations count while in flight
    assert b.settle([(A, 100, True), (B, 100, False), (C, 100, True)]) == [True, False, True]
    assert b.used_bytes == 2 * (H + 100) and sorted(b.keys()) == sorted([A, C])
    assert b.reserve([A, B], [100, 100]).out == [Status.OK, None]  # held already; room for B again
    assert b.footprint_bytes(100) == H + 100 and b.capacity_bytes == 3 * (H + 100)


def test_two_puts_of_one_key_index_it_once():
    b = ClusterBudget("t", 10_000)
    r1, r2 = b.reserve([A], [10]), b.reserve([A], [10])
    assert r1.out == r2.out == [None]
    assert b.settle([(A, 10, True)]) == [True] and b.settle([(A, 10, True)]) == [False]
    assert b.used_bytes == H + 10 and len(b) == 1


def test_pending_is_held_answers_ok_for_a_key_being_written():
    b = ClusterBudget("t", 10_000, pending_is_held=True)
    assert b.reserve([A], [10]).out == [None]
    assert b.reserve([A], [10]).out == [Status.OK]
    b.settle([(A, 10, True)])
    assert b.used_bytes == H + 10


def test_only_decides_the_items_named():
    b = ClusterBudget("t", 10_000)
    res = b.reserve([A, B, C], [1, 2, 3], only=[1])
    assert res.out == [None, None, None] and res.todo == [1] and b.used_bytes == H + 2


def test_gone_reports_once_and_forget_never():
    b = ClusterBudget("t", 10_000)
    b.settle([(k, 10, True) for k in (A, B, C) if b.reserve([k], [10]).todo])
    b.gone([A, D])  # D was never indexed: not reported
    b.gone([D], report=True)  # removed by this instance: reported anyway
    b.forget([B])
    assert b.drain_dropped() == [A, D] and b.drain_dropped() == []
    assert b.keys() == [C] and b.used_bytes == H + 10
    assert b.stats() == {"blocks": 1, "gone": 1, "evicted": 0}


def test_evict_takes_least_recently_used_first_and_learn_waits_for_the_removal():
    b = ClusterBudget("t", 3 * (H + 10))
    for k in (A, B, C):
        b.settle([(k, 10, True)] if b.reserve([k], [10]).todo else [])
    b.touch(A, 10)  # A is the most recently used now
    res = b.reserve([D], [10], evict=True)
    assert res.out == [None] and res.victims == [B]
    assert b.drain_dropped() == [B] and B not in b
    b.learn(B, 10)  # its file is not removed yet: not learned
    assert B not in b
    b.evicted(res.victims)
    b.settle([(D, 10, True)])
    b.learn(B, 10)
    assert B in b and b.size_of(B) == 10 and b.stats()["evicted"] == 1
    assert b.reserve([bytes(16)], [10_000], evict=True).out == [Status.NO_SPACE]  # larger than the whole budget


def test_resync_drops_what_is_missing_and_learns_the_rest_in_order():
    b = ClusterBudget("t", 10_000)
    for k in (A, B):
        b.settle([(k, 10, True)] if b.reserve([k], [10]).todo else [])
    pending = b.reserve([C], [10])
    b.resync([(D, 5), (B, 10)])  # A is gone; C is being written: left alone
    assert b.keys() == [B, D] and b.drain_dropped() == [A]
    b.settle([(C, 10, True)])
    assert pending.todo == [0] and b.used_bytes == 3 * H + 25


@pytest.mark.parametrize("kwargs", [{"capacity_bytes": 0}, {"capacity_bytes": 1, "overhead_bytes": -1}])
def test_bad_sizes_are_refused_at_construction(kwargs):
    with pytest.raises(ArgumentError):
        ClusterBudget("t", **kwargs)
