"""A Mooncake node dies with blocks in its segment while the master still
lists them (its client_ttl has not run out, as when the ucm service is
SIGKILLed and restarted at once).

What a node relies on: a block it cannot read because its holder is gone is
taken out of the pool as soon as it finds that out, so that lookups stop
counting it and storing the same key again writes it again (instead of
"already present" for bytes nobody can read); the rewritten block loads.
"""
from __future__ import annotations


from cluster_servers import MooncakeMaster, NodeProcess, adapter_class, blocks, require, require_module

from ucm.adapters.base import Status

SIZE = 256 << 10


def _options(master, **over):
    return {"master": master.address, "segment_size": "64MiB", "local_buffer_size": "16MiB",
            "probe_interval_s": 0.2, "retry_after_s": 0.3, "key_prefix": "dead/", **over}


def test_blocks_of_a_dead_segment_are_removed_and_can_be_stored_again(tmp_path):
    require("mooncake_master")
    require_module("mooncake.store")
    # A long client_ttl: the master keeps the dead node's segment and objects for the whole test.
    master = MooncakeMaster(workdir=str(tmp_path), extra=["-client_ttl=600"])
    master.start()
    made = []
    try:
        keys, data = blocks(31, 4, SIZE)
        holder = NodeProcess("mooncake", _options(master))  # the only segment: every block lands in it
        assert holder.put(31, 4, SIZE) == ["ok"] * 4
        holder.proc.kill()
        holder.proc.wait()

        cls = adapter_class("mooncake")
        a = cls(capacity_bytes=64 << 20, config=cls.Config(**_options(master)))  # the restarted node
        made.append(a)
        assert a.contains(keys) == [True] * 4  # the master still lists them
        assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [Status.NOT_FOUND] * 4
        assert a.contains(keys) == [False] * 4  # gone from the pool: lookups stop counting them
        assert set(a.drain_dropped()) == set(keys)  # the cache lets them go too

        # Stored again, they are written again (the master may still place a
        # copy in the dead segment: that put fails, and a retry lands elsewhere).
        for key, blob in zip(keys, data):
            for _ in range(40):
                st = a.put([key], [blob])[0]
                if st is Status.OK:
                    break
                assert st is Status.FAILED, st
            assert st is Status.OK
        outs = [bytearray(SIZE) for _ in keys]
        assert a.get(keys, outs) == [Status.OK] * 4
        assert [bytes(o) for o in outs] == data
    finally:
        for a in made:
            a.close()
        master.stop()
