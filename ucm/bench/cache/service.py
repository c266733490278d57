"""`ucm bench service`: the service's control and data planes.

Starts a private `ucm serve` (DRAM tier only) and measures, in one run:
- lookups: `--lookups` calls of `--keys` keys each from 1 and then 2
  client processes at once; throughput (lookups per second over all
  clients) and per-call latency percentiles; once as clients make them
  (answered from the shared key index) and once as requests over the
  socket (`lookup_socket_*`, the path every other operation takes);
- store/load bandwidth through the shared arena (reserve, copy, commit;
  acquire, copy, release) of `--size-mb` of blocks, next to a single-thread
  memcpy of the same blocks measured in the same process.
GB/s are 10^9 bytes per second.
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

from ucm import _native
from ucm.bench import common
from ucm.progress import bar


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "service", help="service lookups per second and arena bandwidth",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_counts(p, lookups=(20000, "lookup requests per client"), keys=(16, "keys per lookup"),
                      size_mb=(256, "bytes stored and loaded, MiB"), block_kb=(2880, "block size, KiB"))
    common.add_json_flag(p)


def _pct(sorted_us: list[float], q: float) -> float:
    return round(common.nearest_rank(sorted_us, q), 1)


def _lookup_worker(sock: str, n: int, n_keys: int, use_index: bool, start: Any, out: Any) -> None:
    from ucm.service.client.cache_client import CacheClient

    keys = [os.urandom(16) for _ in range(n_keys)]
    c = CacheClient(sock, use_index=use_index)
    # Real hits: the looked-up prefix is cached, so every answer is checked.
    c.store(keys, [bytes(4096)] * n_keys).wait(60)
    for _ in range(200):  # warm up
        c.lookup(keys)
    start.wait()
    lat = []
    wrong = 0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        wrong += c.lookup(keys) != n_keys
        lat.append((time.perf_counter() - t) * 1e6)
    out.put((time.perf_counter() - t0, lat, wrong))
    c.close()


def _lookups(sock: str, clients: int, n: int, n_keys: int, use_index: bool = True) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_lookup_worker, args=(sock, n, n_keys, use_index, start, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    wall = max(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    return {"ops_per_s": round(clients * n / wall), "p50_us": _pct(lat, 0.50), "p99_us": _pct(lat, 0.99),
            "wrong": sum(r[2] for r in results)}


def measure(lookups: int, n_keys: int, size_mb: int, block_bytes: int) -> dict[str, Any]:
    from ucm.cache.unified import Outcome
    from ucm.service.client.cache_client import CacheClient

    work = tempfile.mkdtemp(prefix="ucm-bench-service-")
    sock = os.path.join(work, "ucm.sock")
    n_blocks = max(1, (size_mb << 20) // block_bytes)
    arena = n_blocks * ((block_bytes + 4095) // 4096 * 4096) * 2 + (64 << 20)
    cfg = {"tiers": [{"adapter": "dram", "capacity": arena}], "policy": {"name": "lru"},
           "service": {"socket": sock, "metrics_port": None}}
    cfg_path = os.path.join(work, "ucm.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", cfg_path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res: dict[str, Any] = {"block_bytes": block_bytes, "lookup_keys": n_keys}
    steps = bar(total=3, desc="bench service", unit="phase")
    try:
        steps.set_postfix_str("lookups from the key index")
        deadline = time.time() + 120
        while time.time() < deadline:  # ready when a client gets its hello answered
            probe = CacheClient(sock)
            ready = probe.connected
            probe.close()
            if ready:
                break
            time.sleep(0.1)
        one = _lookups(sock, 1, lookups, n_keys)
        two = _lookups(sock, 2, lookups, n_keys)
        res.update({"lookup_1client_ops_per_s": one["ops_per_s"], "lookup_1client_p50_us": one["p50_us"],
                    "lookup_1client_p99_us": one["p99_us"], "lookup_ops_per_s": two["ops_per_s"],
                    "lookup_p50_us": two["p50_us"], "lookup_p99_us": two["p99_us"]})
        steps.update(1)
        steps.set_postfix_str("lookups over the socket")
        s_one = _lookups(sock, 1, lookups, n_keys, use_index=False)
        s_two = _lookups(sock, 2, lookups, n_keys, use_index=False)
        res.update({"lookup_socket_1client_ops_per_s": s_one["ops_per_s"],
                    "lookup_socket_1client_p99_us": s_one["p99_us"],
                    "lookup_socket_ops_per_s": s_two["ops_per_s"], "lookup_socket_p50_us": s_two["p50_us"],
                    "lookup_socket_p99_us": s_two["p99_us"]})
        steps.update(1)
        steps.set_postfix_str("data plane")
        srcs, dsts = [], []
        for _ in range(n_blocks):
            s, d = mmap.mmap(-1, block_bytes), mmap.mmap(-1, block_bytes)
            s[:] = os.urandom(4096) * (block_bytes // 4096) + os.urandom(block_bytes % 4096)
            _native.prefault(d)
            srcs.append(s)
            dsts.append(d)
        total = n_blocks * block_bytes
        t = time.perf_counter()
        for d, s in zip(dsts, srcs):
            _native.copy(d, s)
        res["memcpy_gbps"] = common.gbps(total, time.perf_counter() - t)
        keys = [os.urandom(16) for _ in range(n_blocks)]
        with CacheClient(sock) as c:
            warm = [os.urandom(16) for _ in range(4)]  # fault in the arena pages the client maps
            c.store(warm, srcs[:4]).wait(60)
            t = time.perf_counter()
            st = c.store(keys, srcs).wait(600)
            res["store_gbps"] = common.gbps(total, time.perf_counter() - t)
            for d in dsts:
                d[:8] = bytes(8)
            t = time.perf_counter()
            ld = c.load(keys, dsts).wait(600)
            res["load_gbps"] = common.gbps(total, time.perf_counter() - t)
        res["lookup_wrong_answers"] = sum(r["wrong"] for r in (one, two, s_one, s_two))
        res["ok"] = (res["lookup_wrong_answers"] == 0 and all(o is Outcome.DONE for o in st + ld)
                     and all(d[:] == s[:] for d, s in zip(dsts, srcs)))
        res["store_vs_memcpy"] = round(res["store_gbps"] / res["memcpy_gbps"], 3)
        res["load_vs_memcpy"] = round(res["load_gbps"] / res["memcpy_gbps"], 3)
        steps.update(1)
    finally:
        steps.close()
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    return res


def run(args: argparse.Namespace) -> int:
    res = measure(args.lookups, args.keys, args.size_mb, args.block_kb * 1024)
    common.report(res, args.json, lambda r: common.key_values(r, 28), sort_keys=True)
    return 0 if res.get("ok") else 1
