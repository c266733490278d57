"""ScratchPool: page-aligned mappings handed out and kept warm, at most
`keep` idle ones of at most `max_bytes`, one caller per lease."""
import ctypes
import threading

from ucm.adapters.scratch import GRAIN, ScratchPool


def address(m):
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_a_lease_is_page_aligned_large_enough_and_reused_warm():
    pool = ScratchPool()
    for n in (1, 5000, GRAIN + 1, 3 * GRAIN):
        with pool.lease(n) as m:
            assert len(m) >= n and address(m) % 4096 == 0
            m[n - 1] = 7  # writable to its last byte
    made = pool.made
    for _ in range(10):
        with pool.lease(2 * GRAIN) as m:  # fits an idle mapping: none made
            assert len(m) >= 2 * GRAIN
    assert pool.made == made
    pool.close()


def test_leases_held_at_once_are_distinct_and_at_most_keep_stay_idle():
    pool = ScratchPool(keep=2)
    held = [pool.lease(GRAIN) for _ in range(3)]
    maps = [h.__enter__() for h in held]
    assert len({address(m) for m in maps}) == 3 and pool.made == 3
    for h in held:
        h.__exit__(None, None, None)
    held = [pool.lease(GRAIN) for _ in range(3)]
    for h in held:
        h.__enter__()
    assert pool.made == 4  # two came back warm, the third was unmapped
    for h in held:
        h.__exit__(None, None, None)
    pool.close()


def test_a_lease_above_max_bytes_is_its_own_and_not_kept():
    pool = ScratchPool(max_bytes=GRAIN)
    for _ in range(3):
        with pool.lease(GRAIN + 1) as m:
            assert len(m) == GRAIN + 1
    assert pool.made == 3
    pool.close()


def test_concurrent_leases_never_share_a_mapping():
    """Four threads hold a lease at once (a barrier between writing their
    tag and reading it back), 50 times over: each finds its own tag."""
    pool = ScratchPool(keep=4)
    barrier = threading.Barrier(4)
    bad = []

    def worker(tag):
        for _ in range(50):
            with pool.lease(4096) as m:
                m[:8] = tag * 8
                barrier.wait(10)  # every thread has written into its lease
                if bytes(m[:8]) != tag * 8:
                    bad.append(tag)
                barrier.wait(10)  # nobody gives a lease back before all have checked

    threads = [threading.Thread(target=worker, args=(bytes([t]),)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and pool.made == 4  # four at once, then the same four warm
    pool.close()
