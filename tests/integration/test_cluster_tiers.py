"""Cluster tiers (mooncake, redis, fs) against real servers on 127.0.0.1.

What a cluster relies on: nodes share blocks through the tier; a killed
server means misses, not errors nor hangs, and the tier works again when the
server is back, without restarting anything; bytes that are not exactly what
was stored under a key (damaged, foreign, truncated) are never returned.
The fs tier's own guarantees are in test_fs_tier.py.
"""
from __future__ import annotations

import mmap
import os
import signal
import time

import pytest
from cluster_backends import CAP, SIZE, FsBackend, MooncakeBackend, RedisBackend
from cluster_servers import (MooncakeMaster, NodeProcess, adapter_class, blocks, digest,  # noqa: F401
                             mooncake_master, mooncake_metadata, redis_server, require, require_module)

from ucm.adapters import framing
from ucm.adapters.base import Status

OK, NOT_FOUND, CORRUPT, FAILED, NO_SPACE = Status.OK, Status.NOT_FOUND, Status.CORRUPT, Status.FAILED, Status.NO_SPACE


@pytest.fixture(params=["mooncake", "redis", "fs"])
def backend(request, tmp_path):
    if request.param == "redis":
        b = RedisBackend(request.getfixturevalue("redis_server"))
    elif request.param == "mooncake":
        b = MooncakeBackend(request.getfixturevalue("mooncake_master"))
    else:
        b = FsBackend(str(tmp_path / "shared"))
    yield b
    b.close()


def _ns(backend, tag: str) -> str:
    return tag if backend.name == "fs" else f"{tag}/"


def _check_loaded(statuses, outs, data):
    assert statuses == [OK] * len(data)
    assert [bytes(o) for o in outs] == data


class HeldClock:
    """The time an adapter's circuit breaker reads: the real clock, or, while
    `hold()` is in force, the instant it was held (a breaker that refuses
    calls then refuses them until `release()`, however long the calls take)."""

    def __init__(self):
        self._held = None

    def __call__(self) -> float:
        return self._held if self._held is not None else time.monotonic()

    def hold(self) -> None:
        self._held = time.monotonic()

    def release(self) -> None:
        self._held = None


def _make(backend, options=None, **seams):
    """An adapter (node) on `backend` (its options, `options` over them),
    built with the adapter's own seams (`clock`, `store_factory`); closed
    with the backend."""
    cls = adapter_class(backend.name)
    a = cls(capacity_bytes=CAP, config=cls.Config(**backend.options(**(options or {}))), **seams)
    backend.made.append(a)
    return a


def _wait_until(pred, timeout_s: float, step_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


# ---- sharing ---------------------------------------------------------------------
def test_nodes_share_blocks(backend):
    """Node A stores, node B (another process) looks up and loads identical
    bytes; and the other way round."""
    a = backend.make()
    keys, data = blocks(1, 6, SIZE)
    assert a.put(keys, data) == [OK] * 6
    with NodeProcess(backend.name, backend.options()) as b:
        assert b.contains(1, 6) == [True] * 6
        assert b.get(1, 6, SIZE) == [("ok", digest(d)) for d in data]
        keys2, data2 = blocks(2, 5, SIZE)
        assert b.put(2, 5, SIZE) == ["ok"] * 5
        assert a.contains(keys2) == [True] * 5
        assert a.size_of(keys2[0]) == SIZE
        out = [bytearray(SIZE) for _ in keys2]
        _check_loaded(a.get(keys2, out), out, data2)
        assert b.contains(3, 2) == [False, False]
        assert b.get(3, 2, SIZE) == [("not_found", None)] * 2


def test_mooncake_nodes_share_through_http_metadata_server(mooncake_master, mooncake_metadata):
    backend = MooncakeBackend(mooncake_master, metadata_server=mooncake_metadata.url)
    try:
        a = backend.make()
        keys, data = blocks(4, 4, SIZE)
        assert a.put(keys, data) == [OK] * 4
        with NodeProcess("mooncake", backend.options()) as b:
            assert b.get(4, 4, SIZE) == [("ok", digest(d)) for d in data]
    finally:
        backend.close()


def test_prefixes_keep_deployments_apart(backend):
    a = backend.make(key_prefix=_ns(backend, "deploy-a"))
    b = backend.make(key_prefix=_ns(backend, "deploy-b"))
    keys, data = blocks(5, 3, SIZE)
    assert a.put(keys, data) == [OK] * 3
    assert b.contains(keys) == [False] * 3
    assert b.get(keys, [bytearray(SIZE) for _ in keys]) == [NOT_FOUND] * 3
    assert b.put(keys[:1], [b"x" * SIZE]) == [OK]  # its own block under the same key
    out = bytearray(SIZE)
    assert a.get(keys[:1], [out]) == [OK] and bytes(out) == data[0]


# ---- bytes that are not ours ---------------------------------------------------------
def test_corrupted_or_foreign_bytes_are_never_returned(backend):
    a = backend.make()
    keys, data = blocks(6, 6, SIZE)
    assert a.put(keys, data) == [OK] * 6
    frame = [framing.pack_header(k, d) + d for k, d in zip(keys, data)]
    flipped = bytearray(frame[0])
    flipped[framing.HEADER_BYTES + SIZE // 2] ^= 0x40
    backend.raw_set(a, keys[0], bytes(flipped))  # one payload bit flipped
    backend.raw_set(a, keys[1], frame[2])  # a valid frame of another key
    backend.raw_set(a, keys[2], os.urandom(framing.HEADER_BYTES + SIZE))  # foreign bytes, right size
    backend.raw_set(a, keys[3], frame[3][:-100])  # truncated
    header = bytearray(frame[4][:framing.HEADER_BYTES])
    header[0:4] = b"XXXX"
    backend.raw_set(a, keys[4], bytes(header) + data[4])  # foreign header, right payload
    out = [bytearray(SIZE) for _ in keys]
    st = a.get(keys, out)
    assert st[:5] == [CORRUPT] * 5
    assert st[5] is OK and bytes(out[5]) == data[5]


def test_destination_size_must_match(backend):
    a = backend.make()
    keys, data = blocks(7, 1, SIZE)
    a.put(keys, data)
    assert a.get(keys, [bytearray(SIZE + 1)]) == [CORRUPT]
    assert a.get(keys, [bytearray(SIZE - 1)]) == [CORRUPT]
    out = bytearray(SIZE)
    assert a.get(keys, [out]) == [OK] and bytes(out) == data[0]


# ---- servers that die ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["mooncake", "redis"], indirect=True)
def test_killed_server_means_misses_then_the_tier_recovers(backend):
    clock = HeldClock()
    a = _make(backend, clock=clock)
    keys, data = blocks(8, 4, SIZE)
    assert a.put(keys, data) == [OK] * 4
    backend.server.kill()
    clock.hold()  # a refusal the first calls cause lasts until release()

    st_get = a.get(keys, [bytearray(SIZE) for _ in keys])
    st_put = a.put(*blocks(9, 2, SIZE))
    assert set(st_get) <= {FAILED, NOT_FOUND} and set(st_put) == {FAILED}
    # The adapter notices (a call found the server unreachable, or its health probe did).
    assert _wait_until(lambda: a.stats()["down"], timeout_s=30), a.stats()
    assert a.stats()["outages"] >= 1
    refused = a.stats()["refused_calls"]
    for _ in range(5):
        assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [FAILED] * 4
        assert a.contains(keys) == [False] * 4
        assert a.put(*blocks(9, 2, SIZE)) == [FAILED] * 2
        assert a.size_of(keys[0]) is None
        assert a.delete(keys[:1]) == [False]
    assert a.stats()["refused_calls"] - refused == 25  # each answered at once: none went to the dead server
    clock.release()

    backend.server.start()
    keys3, data3 = blocks(10, 3, SIZE)
    assert _wait_until(lambda: a.put(keys3, data3) == [OK] * 3, timeout_s=30), a.stats()
    out = [bytearray(SIZE) for _ in keys3]
    _check_loaded(a.get(keys3, out), out, data3)
    # The restarted server starts empty: the old blocks are misses, reported dropped.
    assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [NOT_FOUND] * 4
    assert set(a.drain_dropped()) == set(keys)
    assert set(a.iter_keys()) == set(keys3)
    assert a.used_bytes == 3 * (SIZE + framing.HEADER_BYTES)


def test_mooncake_node_holding_blocks_dies(mooncake_master):
    """Blocks in a crashed node's segment fail fast, then are misses once the
    master drops the segment; never wrong bytes, never a hang."""
    backend = MooncakeBackend(mooncake_master)
    try:
        a = backend.make(segment_size=0)  # every block lands in node B's segment
        with NodeProcess("mooncake", backend.options()) as b:
            keys, data = blocks(21, 4, SIZE)
            assert a.put(keys, data) == [OK] * 4
            b.proc.kill()
            b.proc.wait()

            def missing():
                st = a.get(keys, [bytearray(SIZE) for _ in keys])
                assert set(st) <= {FAILED, NOT_FOUND}, st
                return st == [NOT_FOUND] * 4

            assert _wait_until(missing, timeout_s=40, step_s=1.0)
            # Failing fast: the master answered every call (no RPC failed or
            # timed out, which would trip the breaker); only the dead
            # holder's transfers failed, and its endpoint refuses connections.
            assert a.stats()["outages"] == 0, a.stats()
            assert set(a.drain_dropped()) == set(keys)
    finally:
        backend.close()


def test_redis_hung_server_times_out(redis_server):
    backend = RedisBackend(redis_server)
    try:
        clock = HeldClock()
        a = _make(backend, {"socket_timeout_s": 0.5, "retry_after_s": 0.5}, clock=clock)
        keys, data = blocks(11, 2, SIZE)
        assert a.put(keys, data) == [OK] * 2
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            clock.hold()
            assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [FAILED] * 2
            # It gave up at the socket timeout and tripped the breaker: the
            # next call is answered at once instead of waiting on the server.
            assert a.stats()["outages"] == 1 and a.stats()["down"]
            refused = a.stats()["refused_calls"]
            assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [FAILED] * 2
            assert a.stats()["refused_calls"] == refused + 1
        finally:
            clock.release()
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        out = [bytearray(SIZE) for _ in keys]
        assert _wait_until(lambda: a.get(keys, out) == [OK] * 2, timeout_s=10)
        assert [bytes(o) for o in out] == data
    finally:
        backend.close()


def test_mooncake_adapter_built_while_master_is_down(tmp_path):
    require("mooncake_master")
    require_module("mooncake.store")
    master = MooncakeMaster(workdir=str(tmp_path))  # a port, no process yet
    backend = MooncakeBackend(master)
    try:
        from mooncake.store import MooncakeDistributedStore

        clients = []

        def store_factory():
            clients.append(MooncakeDistributedStore())
            return clients[-1]

        a = _make(backend, store_factory=store_factory)
        # Built without trying the client's setup (which retries for
        # seconds): no master answered the TCP probe, so no client was made.
        assert clients == [] and a.stats()["ready"] is False
        keys, data = blocks(12, 2, SIZE)
        assert a.put(keys, data) == [FAILED] * 2
        assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [FAILED] * 2
        master.start()
        assert _wait_until(lambda: a.put(keys, data) == [OK] * 2, timeout_s=30), a.stats()
        out = [bytearray(SIZE) for _ in keys]
        _check_loaded(a.get(keys, out), out, data)
    finally:
        backend.close()
        master.stop()


# ---- the store's own eviction ------------------------------------------------------------
def test_redis_expiry_is_a_reported_miss(redis_server):
    backend = RedisBackend(redis_server)
    try:
        a = backend.make(ttl_s=0.3)
        keys, data = blocks(13, 3, SIZE)
        assert a.put(keys, data) == [OK] * 3
        assert a.used_bytes == 3 * (SIZE + framing.HEADER_BYTES)
        time.sleep(0.6)
        assert a.get(keys, [bytearray(SIZE) for _ in keys]) == [NOT_FOUND] * 3
        assert set(a.drain_dropped()) == set(keys)
        assert a.used_bytes == 0 and list(a.iter_keys()) == []
    finally:
        backend.close()


def test_redis_server_eviction_never_returns_wrong_bytes(tmp_path):
    require("redis-server")
    require_module("redis")
    from ucm.bench.cache.cluster_io import RedisServer

    with RedisServer(workdir=str(tmp_path), maxmemory="8mb") as server:
        backend = RedisBackend(server)
        try:
            a = backend.make(capacity=256 << 20)
            keys, data = blocks(14, 80, SIZE)  # 20 MiB into 8 MiB
            st = []
            for i in range(0, 80, 10):
                st += a.put(keys[i:i + 10], data[i:i + 10])
            assert set(st) <= {OK, NO_SPACE}
            out = [bytearray(SIZE) for _ in keys]
            got = a.get(keys, out)
            assert set(got) <= {OK, NOT_FOUND} and OK in got and NOT_FOUND in got
            for s, o, d in zip(got, out, data):
                if s is OK:
                    assert bytes(o) == d
            dropped = set(a.drain_dropped())
            assert dropped == {k for k, s, p in zip(keys, got, st) if s is NOT_FOUND and p is OK}
        finally:
            backend.close()


def test_mooncake_full_pool_is_no_space_and_evictions_are_reported(mooncake_master):
    backend = MooncakeBackend(mooncake_master)
    try:
        a = backend.make(capacity=1 << 30, segment_size="32MiB")  # the pool, not the budget, runs out
        size = 1 << 20
        keys, data = blocks(20, 60, size)
        st = []
        for i in range(0, 60, 10):
            st += a.put(keys[i:i + 10], data[i:i + 10])
        assert set(st) == {OK, NO_SPACE}
        out = [bytearray(size) for _ in keys]
        got = a.get(keys, out)
        assert set(got) <= {OK, NOT_FOUND} and OK in got
        for s, o, d in zip(got, out, data):
            if s is OK:
                assert bytes(o) == d
        evicted = {k for k, s, p in zip(keys, got, st) if s is NOT_FOUND and p is OK}
        assert set(a.drain_dropped()) == evicted
        assert a.used_bytes == sum(size + framing.HEADER_BYTES for s in got if s is OK)
    finally:
        backend.close()


# ---- memory for the mooncake transfer engine ------------------------------------------------
def test_mooncake_staging_and_registered_memory(mooncake_master):
    """With zero copy of unregistered memory off (as on RDMA), buffers go
    through the registered staging area, registered memory directly."""
    backend = MooncakeBackend(mooncake_master)
    try:
        a = backend.make(zero_copy_unregistered=False, staging_size="4MiB", concurrency=2)
        keys, data = blocks(15, 12, SIZE)  # 3 MiB: several store calls through 1 MiB halves
        assert a.put(keys, data) == [OK] * 12
        out = [bytearray(SIZE) for _ in keys]
        _check_loaded(a.get(keys, out), out, data)
        staged = a.stats()["staged_bytes"]
        assert staged == 2 * 12 * SIZE

        arena = mmap.mmap(-1, 8 * SIZE)
        a.register_memory(arena)
        view = memoryview(arena)
        k2, d2 = blocks(16, 4, SIZE)
        for i, d in enumerate(d2):
            view[i * SIZE:(i + 1) * SIZE] = d
        src = [view[i * SIZE:(i + 1) * SIZE] for i in range(4)]
        dst = [view[(4 + i) * SIZE:(5 + i) * SIZE] for i in range(4)]
        assert a.put(k2, src) == [OK] * 4
        _check_loaded(a.get(k2, dst), dst, d2)
        assert a.stats()["staged_bytes"] == staged  # nothing staged
        with pytest.raises(Exception):
            a.register_memory(arena)  # overlaps
        from ucm.errors import ArgumentError
        with pytest.raises(ArgumentError):
            a.put([os.urandom(16)], [bytes(2 << 20)])  # beyond the staging room, unregistered
        for v in src + dst:
            v.release()
        view.release()
        a.unregister_memory(arena)
    finally:
        backend.close()


# ---- the benchmark ---------------------------------------------------------------------
@pytest.mark.parametrize("tier", ["mooncake", "redis", "fs"])
def test_bench_reports_tier_and_raw(tier, tmp_path):
    if tier == "mooncake":
        require("mooncake_master")
        require("mooncake_client")
        require_module("mooncake.store")
    elif tier == "redis":
        require("redis-server")
        require_module("redis")
    from ucm.bench.cache.cluster_io import measure_tier

    res = measure_tier(tier, size_mb=4, block_kb=256, batch=4, repeats=1, directory=str(tmp_path))
    for k in ("tier_store_gbps", "tier_load_gbps", "raw_store_gbps", "raw_load_gbps"):
        assert res[k] > 0
    assert res["ok"] is True
    assert res["blocks"] == 16
