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
