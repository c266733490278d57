"""SlabArena: slots in size classes, carved from extents that go back to a
free pool when empty, so that a second block size gets room."""
import pytest

from ucm.adapters.slab import MIN_EXTENTS, SlabArena
from ucm.errors import ArgumentError

KiB = 1024
MiB = 1024 * KiB


def test_slots_are_aligned_reused_and_bounded():
    a = SlabArena(16 * 8192, extent_bytes=8192)  # 16 extents of 8 KiB: one 8 KiB slot each
    offs = [a.alloc(5000) for _ in range(16)]
    assert offs == [i * 8192 for i in range(16)]
    assert a.alloc(5000) is None and a.used_bytes == a.capacity_bytes == 16 * 8192
    a.free(offs[2], 5000)
    assert a.alloc(8000) == 16384
    with pytest.raises(ArgumentError):
        a.alloc(0)


def test_extent_size_is_a_bound_and_small_arenas_get_several():
    whole = SlabArena(1024 * MiB)
    assert (whole.extent_count, whole.extent_bytes, whole.capacity_bytes) == (16, 64 * MiB, 1024 * MiB)
    big = SlabArena(1000 * MiB)  # 64 MiB does not divide it: 8 MiB extents use every byte
    assert (big.extent_count, big.extent_bytes, big.capacity_bytes) == (125, 8 * MiB, 1000 * MiB)
    ragged = SlabArena(1024 * MiB + 4096)  # only 4 KiB divides it: 64 MiB extents, the last page unused
    assert (ragged.extent_count, ragged.extent_bytes, ragged.capacity_bytes) == (16, 64 * MiB, 1024 * MiB)
    assert SlabArena(3 * MiB, extent_bytes=3 * MiB // 8).extent_bytes == 3 * MiB // 8  # taken as given
    small = SlabArena(1 * MiB)
    assert (small.extent_count, small.extent_bytes) == (MIN_EXTENTS, 128 * KiB)
    odd = SlabArena(96 * KiB)  # a power of two of which it holds 8: twelve of 8 KiB, no byte lost
    assert (odd.extent_count, odd.extent_bytes, odd.capacity_bytes) == (12, 8 * KiB, 96 * KiB)
    assert [odd.alloc(8 * KiB) for _ in range(13)].count(None) == 1  # twelve 8 KiB blocks fit
    tiny = SlabArena(10 * 4096)  # fewer pages than MIN_EXTENTS extents of two pages: one page each
    assert (tiny.extent_count, tiny.extent_bytes, tiny.capacity_bytes) == (10, 4096, 10 * 4096)
    assert SlabArena(0).capacity_bytes == 0 and SlabArena(0).alloc(1) is None
    with pytest.raises(ArgumentError, match="extent_bytes must be >= align"):
        SlabArena(1 * MiB, extent_bytes=1000)


def test_slots_never_straddle_extents_and_cost_their_share():
    a = SlabArena(1 * MiB)  # 8 extents of 128 KiB
    offs = [a.alloc(96 * KiB) for _ in range(8)]  # one per extent, 32 KiB of each unused
    assert offs == [i * 128 * KiB for i in range(8)]
    assert a.alloc(96 * KiB) is None
    assert a.footprint_bytes(96 * KiB) == 128 * KiB and a.used_bytes == a.capacity_bytes
    assert a.footprint_bytes(64 * KiB) == 64 * KiB and a.footprint_bytes(40 * KiB) == 128 * KiB // 3


def test_an_empty_extent_goes_to_another_class():
    a = SlabArena(1 * MiB)
    small = [a.alloc(64 * KiB) for _ in range(16)]  # two per extent: the arena is full
    assert None not in small and a.alloc(64 * KiB) is None
    assert a.alloc(96 * KiB) is None  # no extent free for the second block size
    a.free(small[5], 64 * KiB)  # extent 2 keeps one live slot: still the small class's
    assert a.free_extents == 0 and a.alloc(96 * KiB) is None
    a.free(small[4], 64 * KiB)  # extent 2 is empty: back in the pool
    assert a.free_extents == 1
    big = a.alloc(96 * KiB)
    assert big == 2 * 128 * KiB
    assert a.alloc(64 * KiB) is None  # the small class lost that extent
    a.free(big, 96 * KiB)
    assert a.free_extents == 1 and not a.has_class(96 * KiB)
    assert a.alloc(64 * KiB) == 2 * 128 * KiB and a.has_class(64 * KiB)


def test_a_slot_larger_than_an_extent_takes_a_contiguous_run():
    a = SlabArena(1 * MiB)  # 128 KiB extents
    assert a.span_of(200 * KiB) == 2 and a.footprint_bytes(200 * KiB) == 256 * KiB
    small = [a.alloc(64 * KiB) for _ in range(16)]
    for i in (2, 3, 6, 7):  # extents 1 and 3 free: two extents, but not adjacent
        a.free(small[i], 64 * KiB)
    assert a.free_extents == 2 and a.alloc(200 * KiB) is None
    for i in (4, 5):  # extent 2 as well: extents 1..3 free
        a.free(small[i], 64 * KiB)
    run = a.alloc(200 * KiB)
    assert run == 1 * 128 * KiB and a.free_extents == 1
    assert a.extent_of(run + 150 * KiB) == 1  # the second extent belongs to the run
    assert SlabArena(1 * MiB).alloc(2 * MiB) is None  # more extents than the arena has
    a.free(run, 200 * KiB)
    assert a.free_extents == 3


def test_release_candidates_name_the_cheapest_unit():
    a = SlabArena(1 * MiB)
    small = [a.alloc(64 * KiB) for _ in range(16)]
    a.free(small[9], 64 * KiB)  # extent 4 holds one live slot
    a.free(small[13], 64 * KiB)  # and extent 6
    everything = lambda head: True  # noqa: E731
    assert a.release_candidates(96 * KiB, everything) == [4]  # fewest live, lowest address
    assert a.release_candidates(96 * KiB, lambda head: head != 4) == [6]
    assert a.release_candidates(96 * KiB, lambda head: head not in (4, 6)) == [0]
    assert a.release_candidates(96 * KiB, lambda head: head not in (4, 6), partial_only=True) is None
    assert a.release_candidates(64 * KiB, everything, partial_only=True) is None  # its own class
    assert a.release_candidates(96 * KiB, lambda head: False) is None
    # A run needs contiguous extents: the cheapest window of two.
    a.free(small[11], 64 * KiB)
    assert [(u.head, u.live) for u in a.units()][3:7] == [(3, 2), (4, 1), (5, 1), (6, 1)]
    assert a.release_candidates(200 * KiB, everything) == [4, 5]
    assert a.release_candidates(200 * KiB, lambda head: head not in (4, 5)) == [6, 7]


def test_free_of_a_slot_it_did_not_hand_out_is_refused():
    a = SlabArena(1 * MiB)
    off = a.alloc(64 * KiB)
    with pytest.raises(ArgumentError, match="no live slot"):
        a.free(off + 128 * KiB, 64 * KiB)
    with pytest.raises(ArgumentError, match="no live slot"):
        a.free(off, 96 * KiB)
