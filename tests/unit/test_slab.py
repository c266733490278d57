import pytest

from ucm.adapters.slab import SlabArena
from ucm.errors import ArgumentError


def test_slots_are_aligned_reused_and_bounded():
    a = SlabArena(10 * 4096)
    offs = [a.alloc(5000) for _ in range(5)]  # 8 KiB slots
    assert offs == [0, 8192, 16384, 24576, 32768]
    assert a.alloc(5000) is None and a.used_bytes == 40960
    a.free(offs[2], 5000)
    assert a.alloc(8000) == 16384
    with pytest.raises(ArgumentError):
        a.alloc(0)
