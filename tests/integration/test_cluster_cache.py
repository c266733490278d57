"""Two nodes' caches share blocks through each cluster tier: fs on a common
directory, Redis and the Mooncake store on servers started on 127.0.0.1."""
import os

import pytest

from ucm.cache.unified import Outcome, UnifiedCache
from support import chain

SIZE = 64 * 1024


def _tier_options(tier, shared_dir):
    if tier == "fs":
        return {"path": shared_dir}
    var = {"redis": "UCMTEST_REDIS_URL", "mooncake": "UCMTEST_MOONCAKE_MASTER"}[tier]
    if not os.environ.get(var):
        pytest.skip(f"no {tier} server here")
    prefix = f"nodes/{os.path.basename(shared_dir)}/"
    if tier == "redis":
        return {"url": os.environ[var], "key_prefix": prefix}
    return {"master": os.environ[var], "segment_size": "32MiB", "local_buffer_size": "16MiB", "key_prefix": prefix}


def node(shared_dir, dram="512KiB", tier="fs"):
    return UnifiedCache({"tiers": [{"adapter": "dram", "capacity": dram},
                                   {"adapter": tier, "capacity": "64MiB", "options": _tier_options(tier, shared_dir)}],
                         "policy": {"name": "lru"}})


@pytest.mark.parametrize("tier", ["fs", "redis", "mooncake"])
def test_node_b_finds_and_loads_what_node_a_demoted(tmp_path, cluster_servers, tier):
    shared = str(tmp_path / "pool")
    keys, data = chain(20, 1)  # 1.25 MiB into 512 KiB of DRAM: the prefix goes down to the pool
    a = node(shared, tier=tier)  # stays up: a Mooncake node's memory is part of the pool
    assert a.store(keys, data).wait(30) == [Outcome.DONE] * 20
    down = [k for k, t in zip(keys, a.locate(keys)) if t == tier]
    assert down and down == keys[:len(down)]
    with a, node(shared, dram="4MiB", tier=tier) as b:
        assert b.lookup(keys) == len(down)  # nothing local: the pool's consecutive prefix
        assert b.locate(keys[:len(down)]) == [tier] * len(down)
        out = [bytearray(SIZE) for _ in down]
        assert b.load(down, out).wait(30) == [Outcome.DONE] * len(down)
        assert [bytes(o) for o in out] == data[:len(down)]
        assert b.locate(down) == ["dram"] * len(down)  # promoted into node B's DRAM
        assert b.lookup(keys) == len(down)


def test_bad_bytes_in_the_pool_are_a_miss(tmp_path):
    shared = str(tmp_path / "pool")
    keys, data = chain(12, 2)
    with node(shared) as a:
        a.store(keys, data).wait(30)
        down = [k for k, t in zip(keys, a.locate(keys)) if t == "fs"]
    victim = next((tmp_path / "pool").rglob(down[0].hex() + "*"))
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with node(shared, dram="4MiB") as b:
        out = [bytearray(SIZE) for _ in down]
        res = b.load(down, out).wait(30)
        assert res[0] is Outcome.CORRUPT
        assert all(r is not Outcome.DONE or bytes(o) == d for r, o, d in zip(res, out, data))


def _copy_in(data):
    def fill(first, slots, arena):
        for i, s in enumerate(slots):
            if s is not None:
                off, n = s
                arena[off:off + n] = data[first + i]
    return fill


@pytest.mark.parametrize("tier", ["fs", "redis", "mooncake"])
def test_a_write_through_tier_gets_every_block_stored_at_once(tmp_path, cluster_servers, tier):
    """Blocks that fit node A's DRAM (never demoted) are in the cluster tier
    as soon as they are stored, by a store or a slot write, for node B."""
    shared = str(tmp_path / "pool")
    opts = _tier_options(tier, shared)
    keys, data = chain(8, 3)
    cfg = {"tiers": [{"adapter": "dram", "capacity": "4MiB"},
                     {"adapter": tier, "capacity": "64MiB", "options": opts, "write_through": True}],
           "policy": {"name": "lru"}}
    with UnifiedCache(cfg) as a:
        assert a.store(keys[:4], data[:4]).wait(30) == [Outcome.DONE] * 4
        assert a.write_slots(keys[4:], [SIZE] * 4, _copy_in(data[4:]), parent=keys[3]) == [Outcome.DONE] * 4
        assert a.flush(30)
        assert a.locate(keys) == ["dram"] * 8  # node A keeps them where they were
        assert a.stats()["write_through_blocks"] == 8
        with node(shared, dram="4MiB", tier=tier) as b:
            assert b.lookup(keys) == 8
            out = [bytearray(SIZE) for _ in keys]
            assert b.load(keys, out).wait(30) == [Outcome.DONE] * 8
            assert [bytes(o) for o in out] == data


def test_a_write_through_put_reads_the_block_slot_leased_until_it_ends(tmp_path):
    """The copy for the cluster tier is put straight from the block's slot in
    the shared-memory landing tier, not from a copy of it; the slot is leased
    meanwhile, so a block deleted from DRAM during the put keeps its bytes
    (its slot is not handed to another block) and the pool gets them."""
    import numpy as np

    keys, data = chain(4, 7)
    cfg = {"tiers": [{"adapter": "dram", "capacity": 4 * SIZE},  # room for exactly these 4 blocks
                     {"adapter": "fs", "capacity": "64MiB", "options": {"path": str(tmp_path / "pool")},
                      "write_through": True}],
           "policy": {"name": "lru"}}
    with UnifiedCache(cfg) as a:
        dram, pool = a.adapters[0], a.adapters[1]
        segment = dram.segment_view()
        base = int(np.frombuffer(segment, dtype=np.uint8).ctypes.data)
        put, seen = pool.put, {}

        def put_during_a_delete(ks, blobs):
            for k, b in zip(ks, blobs):
                at = int(np.frombuffer(b, dtype=np.uint8).ctypes.data)
                seen[k] = base <= at < base + len(segment)
            if keys[0] in ks:
                assert dram.delete([keys[0]]) == [True]  # gone from DRAM while its copy is on its way
                assert dram.reserve(b"\x01" * 16, SIZE) is None  # and its slot is still the put's
            return put(ks, blobs)

        pool.put = put_during_a_delete
        assert a.store(keys, data).wait(30) == [Outcome.DONE] * 4
        assert a.flush(30)
        assert seen and all(seen.values())  # every block put from its slot in the segment
        assert a.stats()["write_through_blocks"] == 4
    with node(str(tmp_path / "pool"), dram="4MiB") as b:
        out = [bytearray(SIZE) for _ in keys]
        assert b.load(keys, out).wait(30) == [Outcome.DONE] * 4
        assert [bytes(o) for o in out] == data


def test_a_landing_tier_without_slots_is_copied_out_for_the_write_through(tmp_path):
    """NVMe as the landing tier (no shared slots): each block is read into a
    buffer of its own and put from there; node B reads the same bytes."""
    keys, data = chain(3, 8)
    cfg = {"landing_tier": "nvme",
           "tiers": [{"adapter": "nvme", "capacity": "64MiB", "options": {"path": str(tmp_path / "nvme")}},
                     {"adapter": "fs", "capacity": "64MiB", "options": {"path": str(tmp_path / "pool")},
                      "write_through": True}],
           "policy": {"name": "lru"}}
    with UnifiedCache(cfg) as a:
        assert a.store(keys, data).wait(30) == [Outcome.DONE] * 3
        assert a.flush(30)
        assert a.stats()["write_through_blocks"] == 3
    with node(str(tmp_path / "pool"), dram="4MiB") as b:
        out = [bytearray(SIZE) for _ in keys]
        assert b.load(keys, out).wait(30) == [Outcome.DONE] * 3
        assert [bytes(o) for o in out] == data


@pytest.mark.parametrize("tiers, why", [
    ([{"adapter": "dram", "capacity": "4MiB", "write_through": True}], "only a tier below the landing tier"),
    ([{"adapter": "dram", "capacity": "4MiB"},
      {"adapter": "nvme", "capacity": "64MiB", "write_through": True, "options": {"path": "{tmp}"}}],
     "only a tier other nodes read"),
])
def test_write_through_needs_a_cluster_tier_below_the_landing_one(tmp_path, tiers, why):
    from ucm.errors import ConfigError

    for t in tiers:
        if "path" in t.get("options", {}):
            t["options"]["path"] = str(tmp_path)
    with pytest.raises(ConfigError, match=f"tiers.[01].write_through: {why}"):
        UnifiedCache({"tiers": tiers}).close()
