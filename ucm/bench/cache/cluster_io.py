"""Cluster-tier bandwidth next to the raw client of the same store, same run.

`measure_tier(tier, ...)` backs `ucm bench io --tier mooncake|redis|fs`. In one
process it moves the same blocks, `batch` per call, alternately through the
store's own client ("raw") and through the ucm adapter ("tier"), `repeats`
times, and reports the medians (GB/s = 10^9 bytes per second):

- mooncake: raw is `batch_put_from` / `batch_get_into` of the adapter's own
  `MooncakeDistributedStore` (same connection, same pool, same memory); the
  tier adds the framing header, the XXH3-64 checksum on the way in and its
  verification on the way back. With no `master` given, a `mooncake_master`
  is started on 127.0.0.1 (free ports) and, with `pool="peer"` (the default
  then), a `mooncake_client` pool node holding the pool memory, so blocks
  cross the transfer engine (tcp) as they would to another node; with
  `pool="local"` the bench process holds the pool itself (the transfer
  degenerates to memcpy).
- redis: raw is a redis-py pipeline of `SET` / `GET` of the same payloads
  (values as bytes, not copied into the destination); the tier is the redis
  adapter. With no `redis_url`, a `redis-server` is started on 127.0.0.1 (a
  free port, no persistence) if the binary is installed.
- fs: raw writes and reads one plain file per block on the same directory
  with the same number of threads; the tier is the fs adapter (header,
  checksum, temporary name and rename).

The stores' servers it starts (`RedisServer`, `MooncakeMaster`,
`MooncakePoolNode`) are in local_servers.py; they are also named here, where
the integration tests import them from.
"""
from __future__ import annotations

import logging
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from ucm import _native
from ucm.adapters.base import Status
from ucm.bench.common import gbps
from ucm.bench.cache.local_servers import (  # noqa: F401  (named here for the tests, which import them from here)
    LocalServer,
    MooncakeMaster,
    MooncakeMetadataServer,
    MooncakePoolNode,
    RedisServer,
    find_binary,
)
from ucm.errors import AdapterError, ArgumentError

log = logging.getLogger(__name__)

TIERS = ("mooncake", "redis", "fs")


# ---- measurement --------------------------------------------------------------
def _arena(n: int, size: int, fill: bool) -> tuple[mmap.mmap, list[memoryview]]:
    m = mmap.mmap(-1, n * size)
    _native.prefault(m)
    if fill:
        chunk = os.urandom(1 << 20)
        for off in range(0, n * size, len(chunk)):
            m[off:off + len(chunk)] = chunk[:n * size - off]
        view = memoryview(m)
        for i in range(n):  # each block distinct
            view[i * size:i * size + 16] = os.urandom(16)
        view.release()
    mv = memoryview(m)
    return m, [mv[i * size:(i + 1) * size] for i in range(n)]


class _Runner:
    """Raw client operations of one tier, and the adapter."""

    adapter: Any
    info: dict[str, Any]
    raw_places_bytes = True  # raw_get fills the destinations (else only their first 16 bytes)

    def raw_put(self, idx: range) -> None: ...
    def raw_get(self, idx: range) -> None: ...
    def raw_clear(self) -> None: ...
    def close(self) -> None: ...


def measure_tier(tier: str, *, size_mb: int = 256, block_kb: int = 2880, batch: int = 16, repeats: int = 3,
                 master: Optional[str] = None, metadata_server: Optional[str] = None, pool: Optional[str] = None,
                 redis_url: Optional[str] = None, directory: Optional[str] = None,
                 io_threads: int = 8, adapter_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Bandwidth of the `tier` adapter next to its raw client; one dict with
    `tier_store_gbps`, `tier_load_gbps`, `raw_store_gbps`, `raw_load_gbps`,
    their ratios (`store_vs_raw`, `load_vs_raw`), `ok` (every status OK and
    every loaded byte equal), the per-repeat samples and what was started.

    mooncake: `master` (host:port; None starts one), `metadata_server`
    (default P2PHANDSHAKE), `pool`: "peer" (start a pool node), "local" (this
    process holds the pool) or "none" (the cluster's pool; default when a
    master is given). redis: `redis_url` (None starts a redis-server). fs:
    `directory` (default a temporary directory under /var/tmp), `io_threads`.
    `adapter_options`: extra options for the adapter's Config.
    """
    if tier not in TIERS:
        raise ArgumentError(f"bench io: unknown cluster tier {tier!r}; choose one of {list(TIERS)}")
    if size_mb <= 0 or block_kb <= 0 or batch <= 0 or repeats <= 0:
        raise ArgumentError("bench io: size_mb, block_kb, batch and repeats must be > 0")
    block = block_kb * 1024
    n = max(1, (size_mb << 20) // block)
    total = n * block
    src_map, srcs = _arena(n, block, fill=True)
    dst_map, dsts = _arena(n, block, fill=False)
    servers: list[LocalServer] = []
    runner: Optional[_Runner] = None
    try:
        if tier == "mooncake":
            runner = _MooncakeRunner(srcs, dsts, block, total, master, metadata_server, pool, servers,
                                     adapter_options)
        elif tier == "redis":
            runner = _RedisRunner(srcs, dsts, redis_url, servers, adapter_options)
        else:
            runner = _FsRunner(srcs, dsts, directory, io_threads, total, adapter_options)
        res = _measure(runner, srcs, dsts, batch, repeats, total)
        res.update({"tier": tier, "block_bytes": block, "blocks": n, "bytes": total, "batch": batch,
                    "repeats": repeats, **runner.info})
        return res
    finally:
        if runner is not None:
            runner.close()
        for s in reversed(servers):
            s.stop()
        for views, m in ((srcs, src_map), (dsts, dst_map)):
            for v in views:
                v.release()
            try:
                m.close()
            except BufferError:
                pass


def _measure(r: _Runner, srcs: list[memoryview], dsts: list[memoryview], batch: int, repeats: int,
             total: int) -> dict[str, Any]:
    """Paired measurement: each batch goes through the raw client and the
    tier back to back (the order alternating), so that both see the same
    conditions on a busy machine; each repeat sums the times of its batches."""
    n = len(srcs)
    batches = [range(i, min(n, i + batch)) for i in range(0, n, batch)]
    samples: dict[str, list[float]] = {k: [] for k in ("raw_store", "raw_load", "tier_store", "tier_load")}
    ok = True

    def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    def same(b: range, prefix_only: bool = False) -> bool:
        if prefix_only:
            return all(dsts[i][:16] == srcs[i][:16] for i in b)
        return all(dsts[i] == srcs[i] for i in b)

    def scrub(b: range) -> None:
        for i in b:
            dsts[i][:16] = bytes(16)

    # Warm-up: the store's memory touched once, outside the clock.
    for b in batches:
        r.raw_put(b)
    r.raw_clear()
    for rep in range(repeats):
        keys = [os.urandom(16) for _ in range(n)]
        t = dict.fromkeys(samples, 0.0)
        for j, b in enumerate(batches):
            kb, sb = [keys[i] for i in b], [srcs[i] for i in b]
            order = ("raw_store", "tier_store") if (rep + j) % 2 == 0 else ("tier_store", "raw_store")
            for name in order:
                if name == "raw_store":
                    dt, _ = clock(lambda: r.raw_put(b))
                else:
                    dt, out = clock(lambda: r.adapter.put(kb, sb))
                    ok = ok and all(s is Status.OK for s in out)
                t[name] += dt
        for j, b in enumerate(batches):
            kb, db = [keys[i] for i in b], [dsts[i] for i in b]
            order = ("raw_load", "tier_load") if (rep + j) % 2 == 0 else ("tier_load", "raw_load")
            for name in order:
                scrub(b)
                if name == "raw_load":
                    dt, _ = clock(lambda: r.raw_get(b))
                    ok = ok and same(b, prefix_only=not r.raw_places_bytes)
                else:
                    dt, out = clock(lambda: r.adapter.get(kb, db))
                    ok = ok and all(s is Status.OK for s in out) and same(b)
                t[name] += dt
        r.raw_clear()
        r.adapter.delete(keys)
        for name, dt in t.items():
            samples[name].append(gbps(total, dt))
    res: dict[str, Any] = {f"{k}_gbps": round(statistics.median(v), 3) for k, v in samples.items()}
    res["store_vs_raw"] = round(res["tier_store_gbps"] / res["raw_store_gbps"], 3)
    res["load_vs_raw"] = round(res["tier_load_gbps"] / res["raw_load_gbps"], 3)
    res["samples"] = samples
    res["ok"] = ok
    res["adapter_stats"] = {k: v for k, v in r.adapter.stats().items() if isinstance(v, (int, float, bool))}
    return res


class _MooncakeRunner(_Runner):
    def __init__(self, srcs: list[memoryview], dsts: list[memoryview], block: int, total: int,
                 master: Optional[str], metadata_server: Optional[str], pool: Optional[str],
                 servers: list[LocalServer], options: Optional[dict[str, Any]] = None) -> None:
        from ucm.adapters.mooncake import MooncakeAdapter, MooncakeConfig

        started = master is None
        pool = pool or ("peer" if started else "none")
        if pool not in ("peer", "local", "none"):
            raise ArgumentError(f"bench io: pool must be peer, local or none, got {pool!r}")
        pool_bytes = 3 * total + (64 << 20)  # raw and tier copies side by side, with room
        if started:
            m = MooncakeMaster()
            servers.append(m)
            m.start()
            master = m.address
        meta = metadata_server or "P2PHANDSHAKE"
        if pool == "peer":
            p = MooncakePoolNode(master, pool_bytes, metadata_server=meta)
            servers.append(p)
            p.start()
        cfg = MooncakeConfig(master=master, metadata_server=meta, local_buffer_size=16 << 20,
                             segment_size=pool_bytes if pool == "local" else 0, key_prefix="ucm-bench/",
                             **(options or {}))
        self.adapter = MooncakeAdapter(capacity_bytes=2 * total, config=cfg)
        self.client = self.adapter.client
        if self.client is None:
            self.adapter.close()
            raise AdapterError(f"bench io: could not join mooncake master {master}")
        self.srcs, self.dsts, self.block = srcs, dsts, block
        self._arenas = [srcs[0].obj, dsts[0].obj]
        for a in self._arenas:  # the DRAM arena of a node: registered once
            self.adapter.register_memory(a)
        self.names = [f"ucm-bench-raw/{i}" for i in range(len(srcs))]
        self.src_addr = [_addr(v) for v in srcs]
        self.dst_addr = [_addr(v) for v in dsts]
        self.info = {"master": master, "started_master": started, "pool": pool, "metadata_server": meta,
                     "raw": "MooncakeDistributedStore.batch_put_from / batch_get_into"}

    def raw_put(self, idx: range) -> None:
        codes = self.client.batch_put_from([self.names[i] for i in idx], [self.src_addr[i] for i in idx],
                                           [self.block] * len(idx))
        if any(c != 0 for c in codes):
            raise AdapterError(f"bench io: raw mooncake put failed: {sorted(set(codes))}")

    def raw_get(self, idx: range) -> None:
        codes = self.client.batch_get_into([self.names[i] for i in idx], [self.dst_addr[i] for i in idx],
                                           [self.block] * len(idx))
        if any(c != self.block for c in codes):
            raise AdapterError(f"bench io: raw mooncake get failed: {sorted(set(codes))}")

    def raw_clear(self) -> None:
        self.client.batch_remove(self.names, True)

    def close(self) -> None:
        for a in self._arenas:
            self.adapter.unregister_memory(a)
        self.adapter.close()


def _addr(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class _RedisRunner(_Runner):
    raw_places_bytes = False
    def __init__(self, srcs: list[memoryview], dsts: list[memoryview], url: Optional[str],
                 servers: list[LocalServer], options: Optional[dict[str, Any]] = None) -> None:
        import redis

        from ucm.adapters.redis import RedisAdapter, RedisConfig

        started = url is None
        if started:
            s = RedisServer()
            servers.append(s)
            s.start()
            url = s.url
        self.adapter = RedisAdapter(capacity_bytes=3 * sum(len(v) for v in srcs),
                                    config=RedisConfig(url=url, key_prefix="ucm-bench/", **(options or {})))
        self.client = redis.Redis.from_url(url)
        self.srcs, self.dsts = srcs, dsts
        self.names = [f"ucm-bench-raw/{i}".encode() for i in range(len(srcs))]
        self.info = {"redis_url": url, "started_server": started,
                     "raw": "redis-py pipeline SET / GET (values as bytes)"}

    def raw_put(self, idx: range) -> None:
        p = self.client.pipeline(transaction=False)
        for i in idx:
            p.set(self.names[i], self.srcs[i])
        p.execute()

    def raw_get(self, idx: range) -> None:
        p = self.client.pipeline(transaction=False)
        for i in idx:
            p.get(self.names[i])
        values = p.execute()
        # Only the first block is placed, so that the load check sees it; the
        # raw number is the client's own GET (its bytes objects), no copy-out.
        for i, v in zip(idx, values):
            if v is None or len(v) != len(self.dsts[i]):
                raise AdapterError(f"bench io: raw redis get of block {i} failed")
            self.dsts[i][:16] = v[:16]

    def raw_clear(self) -> None:
        self.client.unlink(*self.names)

    def close(self) -> None:
        self.client.close()
        self.adapter.close()


class _FsRunner(_Runner):
    def __init__(self, srcs: list[memoryview], dsts: list[memoryview], directory: Optional[str],
                 io_threads: int, total: int, options: Optional[dict[str, Any]] = None) -> None:
        from ucm.adapters.fs import FsAdapter, FsConfig

        base = directory or "/var/tmp"
        os.makedirs(base, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="ucm-bench-fs-", dir=base)
        self.adapter = FsAdapter(capacity_bytes=2 * total,
                                 config=FsConfig(path=self.dir, io_threads=io_threads, scan_on_start=False,
                                                 **(options or {})))
        self.raw_dir = os.path.join(self.dir, "raw")
        os.makedirs(self.raw_dir)
        self.pool = ThreadPoolExecutor(io_threads)
        self.srcs, self.dsts = srcs, dsts
        self.info = {"directory": self.dir, "io_threads": io_threads, "raw": "open/write/close and "
                     "open/readinto/close of one plain file per block, same thread count"}

    def _path(self, i: int) -> str:
        return os.path.join(self.raw_dir, f"{i}")

    def raw_put(self, idx: range) -> None:
        def one(i: int) -> None:
            with open(self._path(i), "wb") as f:
                f.write(self.srcs[i])
        list(self.pool.map(one, idx))

    def raw_get(self, idx: range) -> None:
        def one(i: int) -> None:
            with open(self._path(i), "rb", buffering=0) as f:
                f.readinto(self.dsts[i])
        list(self.pool.map(one, idx))

    def raw_clear(self) -> None:
        for name in os.listdir(self.raw_dir):
            os.unlink(os.path.join(self.raw_dir, name))

    def close(self) -> None:
        self.pool.shutdown()
        self.adapter.close()
        shutil.rmtree(self.dir, ignore_errors=True)
