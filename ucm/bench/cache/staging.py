"""Stores and lookups through `ucm serve` while another client stages from
NVMe: part of `ucm bench placement --service`.

A service with a small DRAM tier over NVMe is filled so that most of a
preloaded prompt lives only on NVMe. Then `clients` processes each store
fresh prompts (`blocks` blocks each) and look them up, for `seconds`:
- alone;
- while one more process loads an NVMe-resident prompt over and over: 96
  blocks through a 32-block DRAM tier, so each load stages most of them
  from NVMe (reads, evictions, demotions), in chunks of 4 blocks (1/8 of
  the arena). The NVMe tier (2,048 blocks) keeps the prompt it hits while
  the others' fresh prompts pass through.
Reported per phase: stores and lookups per second (blocks), and the ratio of
store throughput with staging to without (the issue's goal: >= 0.8).

`baseline`: the source tree of another ucm version (a `git worktree` of the
commit to compare with, with its native module built in place). Its
service and clients run from there (PYTHONPATH), in the same run, with the
same workload, so the figures sit next to each other. The client script
uses only calls both versions have (`CacheClient.store/lookup/load`).
"""
from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Optional

import yaml

from ucm.bench.blocks import chain
from ucm.errors import ArgumentError

BLOCK_BYTES = 256 * 1024
STAGED_BLOCKS = 96
DRAM_BLOCKS = 32
NVME_BLOCKS = 2048

# The client script; it runs under the tree measured (PYTHONPATH), so it
# carries its own copy of `chain` rather than importing this tree's.
_CLIENT = "import hashlib\n\n\n" + inspect.getsource(chain) + textwrap.dedent('''
    import json, sys, time
    from ucm.config.schema import load_config
    from ucm.service import CacheClient
    try:
        from ucm.service.paths import socket_path
    except ImportError:  # an older tree
        from ucm.service.server.serve import socket_path
    cfg = load_config(sys.argv[1]); role = sys.argv[2]; seed = int(sys.argv[3])
    blocks = int(sys.argv[4]); seconds = float(sys.argv[5]); size = int(sys.argv[6])

    c = CacheClient(socket_path(cfg), cfg)
    blob = bytes(size)
    if role == "preload":
        keys = chain(blocks, seed)
        res = c.store(keys, [blob] * blocks).wait(300)
        c.flush()
        print(json.dumps({"stored": sum(r.value == "done" for r in res)}))
        sys.exit(0)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()  # go
    stores = lookups = loads = 0
    n = 0
    t0 = time.perf_counter()
    if role == "stage":
        keys = chain(blocks, seed)
        dsts = [bytearray(size) for _ in keys]
        while time.perf_counter() - t0 < seconds:
            res = c.load(keys, dsts).wait(300)
            loads += sum(r.value == "done" for r in res)
    else:
        while time.perf_counter() - t0 < seconds:
            keys = chain(blocks, seed * 1000003 + n)
            n += 1
            res = c.store(keys, [blob] * blocks).wait(300)
            stores += sum(r.value == "done" for r in res)
            lookups += len(keys) if c.lookup(keys) == len(keys) else 0
    el = time.perf_counter() - t0
    print(json.dumps({"stores": stores, "lookups": lookups, "loads": loads, "seconds": el}))
    c.close()
''')


def _config(tmp: str) -> str:
    nvme = os.path.join(tmp, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": [{"adapter": "dram", "capacity": DRAM_BLOCKS * BLOCK_BYTES, "options": {"prefault": False}},
                     {"adapter": "nvme", "capacity": NVME_BLOCKS * BLOCK_BYTES,
                      "options": {"path": nvme, "region_size": 16 * BLOCK_BYTES}}],
           "landing_tier": "dram", "policy": {"name": "lru"}, "io_workers": 4,
           "service": {"socket": os.path.join(tmp, "ucm.sock")}}
    path = os.path.join(tmp, "ucm.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _env(tree: Optional[str]) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _wait_socket(path: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ArgumentError(f"the service exited with {proc.returncode}: {proc.stdout.read()[-2000:]}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise ArgumentError(f"the service did not open {path} within {timeout_s} s")


def _phase(cfg: str, env: dict, clients: int, stage: bool, blocks: int, seconds: float) -> dict:
    procs = []
    roles = [("store", 100 + i) for i in range(clients)] + ([("stage", 1)] if stage else [])
    for role, seed in roles:
        n = STAGED_BLOCKS if role == "stage" else blocks
        procs.append(subprocess.Popen([sys.executable, "-c", _CLIENT, cfg, role, str(seed), str(n), str(seconds),
                                       str(BLOCK_BYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env))
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise ArgumentError(f"a bench client did not start: {p.communicate()[0][-2000:]}")
    for p in procs:  # all at once
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 300)
        if p.returncode != 0:
            raise ArgumentError(f"a bench client failed ({p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    store = [o for o, (role, _) in zip(outs, roles) if role == "store"]
    secs = max(o["seconds"] for o in store)
    out = {"stores_per_s": sum(o["stores"] for o in store) / secs,
           "lookups_per_s": sum(o["lookups"] for o in store) / secs}
    if stage:
        st = outs[-1]
        out["staged_blocks_per_s"] = st["loads"] / st["seconds"]
    return out


def run_tree(tree: Optional[str], clients: int = 4, blocks: int = 8, seconds: float = 4.0,
             tmp_dir: Optional[str] = None) -> dict:
    """Both phases against the service of `tree` (None: this installation),
    its socket, config and NVMe file in a temporary directory under
    `tmp_dir` (default the system's)."""
    env = _env(tree)
    with tempfile.TemporaryDirectory(prefix="ucm-staging-", dir=tmp_dir) as tmp:
        cfg = _config(tmp)
        proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", cfg], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_socket(os.path.join(tmp, "ucm.sock"), proc)
            alone = _phase(cfg, env, clients, False, blocks, seconds)
            # The prompt to stage, stored now (after the first phase's stores
            # went through): most of it lands on NVMe.
            pre = subprocess.run([sys.executable, "-c", _CLIENT, cfg, "preload", "1", str(STAGED_BLOCKS), "0",
                                  str(BLOCK_BYTES)], env=env, capture_output=True, text=True, timeout=600)
            if pre.returncode != 0 or json.loads(pre.stdout.strip().splitlines()[-1])["stored"] != STAGED_BLOCKS:
                raise ArgumentError(f"preloading the service failed: {pre.stdout[-500:]} {pre.stderr[-2000:]}")
            staging = _phase(cfg, env, clients, True, blocks, seconds)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"alone": alone, "with_staging": staging,
            "store_ratio": staging["stores_per_s"] / alone["stores_per_s"] if alone["stores_per_s"] else 0.0}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median store ratio, and every run's ratio."""
    order = sorted(runs, key=lambda r: r["store_ratio"])
    return {**order[len(order) // 2], "store_ratios": [r["store_ratio"] for r in runs]}


def run(baseline: Optional[str], clients: int = 4, blocks: int = 8, seconds: float = 4.0,
        tmp_dir: Optional[str] = None, repeat: int = 1) -> dict:
    """This installation, and `baseline` (a source tree) if given, `repeat`
    times each, alternating (so that a slow spell of the machine hits both);
    per tree the run with the median store ratio is reported."""
    if baseline is not None and not os.path.isdir(os.path.join(baseline, "ucm")):
        raise ArgumentError(f"--baseline {baseline!r} is not a ucm source tree (no ucm/ inside)")
    if repeat <= 0:
        raise ArgumentError(f"repeat must be > 0, got {repeat}")
    current, base = [], []
    for _ in range(repeat):
        current.append(run_tree(None, clients, blocks, seconds, tmp_dir))
        if baseline is not None:
            base.append(run_tree(baseline, clients, blocks, seconds, tmp_dir))
    out = {"clients": clients, "blocks_per_store": blocks, "block_bytes": BLOCK_BYTES, "seconds": seconds,
           "repeat": repeat, "current": _median_run(current)}
    if baseline is not None:
        out["baseline"] = {"tree": baseline, **_median_run(base)}
    return out
