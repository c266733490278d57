"""Two block sizes share one DRAM tier (two models on one node): UnifiedCache
over the real dram and nvme adapters. The arena hands space to size classes
in extents and takes it back when empty; when the bytes Placement freed sit
in another class's extents, the cache evicts what the arena names
(`victims_for`) and reserves again, so the second size is cached in DRAM and
the first size's blocks are demoted to NVMe, not lost."""
import hashlib

from ucm.cache.unified import Outcome, UnifiedCache

KiB = 1024
A, B = 64 * KiB, 96 * KiB  # model A's and model B's block sizes


def cfg(nvme_dir, dram="1MiB"):  # 1 MiB of DRAM: 8 extents of 128 KiB
    return {"tiers": [{"adapter": "dram", "capacity": dram},
                      {"adapter": "nvme", "capacity": "16MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def block(tag, i, size):
    key = hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()
    return key, hashlib.shake_128(key).digest(size)


def blocks(tag, n, size):
    pairs = [block(tag, i, size) for i in range(n)]
    return [k for k, _ in pairs], [d for _, d in pairs]


def store_each(c, keys, data):
    """One request per block: each is a root, as blocks of unrelated prompts."""
    return [c.store([k], [d]).wait(30)[0] for k, d in zip(keys, data)]


def load_exact(c, keys, data):
    out = [bytearray(len(d)) for d in data]
    assert c.load(keys, out).wait(30) == [Outcome.DONE] * len(keys)
    assert [bytes(o) for o in out] == data


def fill_fragmented(c):
    """Model A fills DRAM, 16 x 64 KiB (two per extent); then the first of
    each extent's pair is used again, so the least recently used blocks,
    the ones Placement evicts by bytes, are spread one per extent."""
    a_keys, a_data = blocks("a", 16, A)
    assert store_each(c, a_keys, a_data) == [Outcome.DONE] * 16
    load_exact(c, a_keys[0::2], a_data[0::2])
    assert c.locate(a_keys) == ["dram"] * 16
    return a_keys, a_data


def test_review_scenario_model_b_is_cached_after_model_a_filled_dram(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        a_keys, a_data = blocks("a", 16, A)
        assert c.store(a_keys, a_data).wait(30) == [Outcome.DONE] * 16  # one prompt of model A
        b_keys, b_data = blocks("b", 4, B)
        assert store_each(c, b_keys, b_data) == [Outcome.DONE] * 4
        assert c.locate(b_keys) == ["dram"] * 4
        s = c.stats()
        assert s["store_refused"] == 0
        where = c.locate(a_keys)
        assert "nvme" in where and None not in where  # demoted, not lost
        load_exact(c, a_keys, a_data)
        load_exact(c, b_keys, b_data)


def test_a_second_size_gets_room_when_freed_bytes_are_scattered(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        a_keys, a_data = fill_fragmented(c)
        b_keys, b_data = blocks("b", 4, B)
        assert store_each(c, b_keys, b_data) == [Outcome.DONE] * 4
        assert c.locate(b_keys) == ["dram"] * 4
        assert c.stats()["store_refused"] == 0
        where = c.locate(a_keys)
        assert where.count("nvme") >= 8 and None not in where  # every A block still cached
        assert c.stats()["slot_evictions"] > 0  # the arena named victims beyond what Placement evicted by bytes
        load_exact(c, a_keys, a_data)  # byte-exact from NVMe (and promoted again)
        load_exact(c, b_keys, b_data)


def test_two_phase_reserve_gets_a_slot_of_the_second_size(nvme_dir):
    """The service's path: reserve / fill / commit, as an engine process does."""
    with UnifiedCache(cfg(nvme_dir)) as c:
        a_keys, a_data = fill_fragmented(c)
        b_keys, b_data = blocks("b", 3, B)
        for k, d in zip(b_keys, b_data):
            (view,) = c.reserve([k], [B])
            assert isinstance(view, memoryview) and len(view) == B
            view[:] = d
            view.release()
            assert c.commit([k]) == [True]
        assert c.locate(b_keys) == ["dram"] * 3 and c.stats()["store_refused"] == 0
        load_exact(c, b_keys, b_data)
        load_exact(c, a_keys, a_data)


def test_staging_a_block_of_the_second_size_into_a_fragmented_dram(nvme_dir):
    """Promotion (prefetch, acquire) reserves slots too: a model-B block on
    NVMe is staged into DRAM although the room Placement made for it lies
    in model A's extents."""
    with UnifiedCache(cfg(nvme_dir)) as c:
        b_keys, b_data = blocks("b", 2, B)
        assert store_each(c, b_keys, b_data) == [Outcome.DONE] * 2
        a_keys, a_data = blocks("a", 16, A)
        assert store_each(c, a_keys, a_data) == [Outcome.DONE] * 16  # B is demoted to make room
        assert c.locate(b_keys) == ["nvme"] * 2 and c.locate(a_keys) == ["dram"] * 16
        load_exact(c, a_keys[0::2], a_data[0::2])  # A's LRU blocks: one per extent
        assert c.prefetch(b_keys[:1]).wait(30) == [Outcome.DONE]
        leases = c.acquire(b_keys[1:])
        try:
            assert leases[0] is not None and bytes(leases[0].view) == b_data[1]
        finally:
            c.release(leases)
        assert c.locate(b_keys) == ["dram"] * 2
        assert None not in c.locate(a_keys)
        load_exact(c, a_keys, a_data)


def test_reconcile_asks_the_arena_for_the_blocks_real_size_not_its_footprint(nvme_dir):
    """8 MiB of DRAM: 8 extents of 1 MiB. Model X's 200 KiB blocks fit five
    to an extent, so each costs 1 MiB / 5 (its footprint), which rounds to
    208 KiB: model Y's size class (four to an extent). With Y's 16 blocks in
    four extents and X's 20 in the other four, the next X block makes
    Placement evict the least recently used Y block by bytes; the arena
    then has a free Y slot but no X slot (NO_SPACE), and the reconcile must
    ask `victims_for` about 200 KiB: the rest of that Y extent goes to NVMe
    and X gets the extent. Asked about the footprint, the arena names one
    more Y block of "the own class" instead, and the retry finds no slot."""
    X, Y = 200 * KiB, 208 * KiB
    with UnifiedCache(cfg(nvme_dir, dram="8MiB")) as c:
        y_keys, y_data = blocks("y", 16, Y)
        assert store_each(c, y_keys, y_data) == [Outcome.DONE] * 16
        x_keys, x_data = blocks("x", 21, X)
        assert store_each(c, x_keys[:20], x_data[:20]) == [Outcome.DONE] * 20
        assert c.locate(y_keys + x_keys[:20]) == ["dram"] * 36
        assert c.stats()["slot_evictions"] == 0
        stored = store_each(c, x_keys[20:], x_data[20:])
        assert stored == [Outcome.DONE], f"slot_evictions={c.stats()['slot_evictions']}"
        assert c.locate(x_keys) == ["dram"] * 21
        assert c.locate(y_keys[:4]) == ["nvme"] * 4, c.locate(y_keys)  # Y's first extent, emptied
        assert c.locate(y_keys[4:]) == ["dram"] * 12
        assert c.stats()["slot_evictions"] == 3 and c.stats()["store_refused"] == 0
        load_exact(c, y_keys, y_data)
        load_exact(c, x_keys, x_data)
