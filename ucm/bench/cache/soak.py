"""`ucm bench soak`: many clients, kills, and a count of every wrong byte.

Starts a private `ucm serve` (a small dram tier over an nvme tier, in temp
directories: the arena in a directory of its own under /dev/shm, the region
file under /var/tmp) and runs `--clients` client processes (multiprocessing,
spawn) for `--minutes`. Each stores, loads and looks up prefixes of chains
drawn from one key space shared by all clients, in two block sizes; a
block's payload is derived from its key (SHAKE-128), so every block loaded
DONE is compared byte for byte with what it must be. Every `--kill-every-s`
seconds on average a random client is killed with SIGKILL (mid-request,
with leases and reservations held) and a replacement started.

Meanwhile the service's RSS and open descriptors and the files in the arena
directory are sampled. At the end, once every client is gone: the leases
and connections the service still counts, DRAM slots the adapter holds
that placement does not know (orphans), whether the arena still takes more
blocks than it holds (no slot lost), descriptors against the start, and
after the service stopped, files it left in the arena directory.

Clients report through one JSON file each, rewritten every half second and
at once after a wrong byte or an exception, so a kill loses at most half a
second of operation counts and never a failure. `ok` (exit status 0) needs
zero wrong bytes, zero exceptions raised into clients, zero timeouts, no
crashed client, zero leases left, no orphaned slot, the refill check, no
descriptor leaked and no file left behind.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any, Optional

import yaml

from ucm.bench import common
from ucm.errors import ArgumentError
from ucm.progress import bar

KEY_SALT = b"ucm-soak-v1"


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "soak", help="clients storing, loading and being killed; every byte checked",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=2.0, help="how long the clients run (fractions allowed)")
    common.add_counts(p, clients=(4, "client processes at any time"))
    p.add_argument("--kill-every-s", type=float, default=3.0,
                   help="mean seconds between SIGKILLs of a random client (0: never; default 3)")
    common.add_counts(p, dram_mb=(16, "dram tier, MiB"), nvme_mb=(96, "nvme tier, MiB"))
    p.add_argument("--block-kb", default="64,200", help="the two block sizes, KiB (default 64,200)")
    common.add_counts(p, chains=(64, "chains in the key space"), max_chain=(8, "blocks per chain"))
    p.add_argument("--seed", type=int, default=None, help="seed of kills and client choices (default: random)")
    common.add_json_flag(p)


# ---- the key space (shared by the clients and the final checks) ----------------------------
def chain_keys(chain: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(KEY_SALT + b"%d:%d" % (chain, i), digest_size=16).digest() for i in range(n)]


def payload(key: bytes, size: int) -> bytes:
    return hashlib.shake_128(key).digest(size)


def wrong_bytes(got: bytes, want: bytes) -> int:
    if got == want:
        return 0
    return sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))


# ---- one client process ------------------------------------------------------------------------
def client_main(idx: int, sock: str, workdir: str, seed: int, sizes: tuple[int, int], chains: int,
                max_chain: int) -> None:
    """Runs until `<workdir>/stop` exists; counts into `<workdir>/client-<idx>.json`."""
    from ucm.cache.unified import Outcome
    from ucm.service.client.cache_client import CacheClient

    rnd = random.Random(seed)
    counts: Counter = Counter()
    errors: list[str] = []
    out_path = os.path.join(workdir, f"client-{idx}.json")
    stop_path = os.path.join(workdir, "stop")

    def flush() -> None:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"counts": counts, "errors": errors[:5]}, f)
        os.replace(tmp, out_path)

    def fault(what: str) -> None:
        counts[what] += 1
        errors.append(traceback.format_exc(limit=6))
        flush()

    client: Optional[CacheClient] = None
    try:
        client = CacheClient(sock, retry_s=0.2)
    except Exception:
        fault("exceptions")
    last = time.monotonic()
    while client is not None and not os.path.exists(stop_path):
        chain = rnd.randrange(chains)
        size = sizes[chain % 2]
        keys = chain_keys(chain, rnd.randint(1, max_chain))
        op = rnd.choices(("store", "load", "lookup"), (35, 40, 25))[0]
        try:
            counts[f"{op}_ops"] += 1
            if op == "store":
                res = client.store(keys, [payload(k, size) for k in keys]).wait(60)
                if res is None:
                    counts["timeouts"] += 1
                    flush()
                else:
                    counts.update(f"store_{o.value}" for o in res)
            elif op == "load":
                dsts = [bytearray(size) for _ in keys]
                res = client.load(keys, dsts).wait(60)
                if res is None:
                    counts["timeouts"] += 1
                    flush()
                else:
                    for k, o, d in zip(keys, res, dsts):
                        counts[f"load_{o.value}"] += 1
                        if o is Outcome.DONE:
                            bad = wrong_bytes(bytes(d), payload(k, size))
                            counts["blocks_verified"] += 1
                            counts["bytes_verified"] += size
                            if bad:
                                counts["wrong_bytes"] += bad
                                counts["wrong_blocks"] += 1
                                errors.append(f"key {k.hex()} ({size} bytes): {bad} wrong bytes")
                                flush()
            else:
                n = client.lookup(keys)
                counts["lookup_hits"] += n
                if not isinstance(n, int) or not 0 <= n <= len(keys):
                    counts["bad_lookups"] += 1
                    errors.append(f"lookup of {len(keys)} keys answered {n!r}")
                    flush()
        except Exception:
            fault("exceptions")
        if time.monotonic() - last > 0.5:
            flush()
            last = time.monotonic()
    try:
        if client is not None:
            client.close()
    except Exception:
        fault("exceptions")
    flush()


# ---- the service and the samples ---------------------------------------------------------------
def _rss_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _files(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def _wait_ready(sock: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> Any:
    from ucm.service.client.cache_client import CacheClient

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ucm serve exited with status {proc.returncode}")
        c = CacheClient(sock, retry_s=0.05)
        if c.connected:
            return c
        c.close()
        time.sleep(0.05)
    raise RuntimeError(f"ucm serve did not answer on {sock} within {timeout_s:g} s")


def soak(minutes: float, clients: int = 4, kill_every_s: float = 3.0, dram_mb: int = 16, nvme_mb: int = 96,
         sizes: tuple[int, int] = (64 << 10, 200 << 10), chains: int = 64, max_chain: int = 8,
         seed: Optional[int] = None) -> dict[str, Any]:
    from ucm.cache.unified import Outcome

    seed = random.randrange(1 << 31) if seed is None else seed
    rnd = random.Random(seed)
    work = tempfile.mkdtemp(prefix="ucm-soak-")
    shm = tempfile.mkdtemp(prefix="ucm-soak-arena-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    nvme = tempfile.mkdtemp(prefix="ucm-soak-nvme-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    sock = os.path.join(work, "ucm.sock")
    region = 1 << 20
    cfg = {"tiers": [{"adapter": "dram", "capacity": dram_mb << 20, "options": {"path": shm}},
                     {"adapter": "nvme", "capacity": nvme_mb << 20,
                      "options": {"path": nvme, "region_size": region, "io_chunk": region // 4}}],
           "policy": {"name": "lru"}, "service": {"socket": sock, "index_slots": 1 << 14, "metrics_port": None}}
    with open(os.path.join(work, "ucm.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    log = open(os.path.join(work, "serve.log"), "w+b")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}  # the config is the file's alone
    svc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", os.path.join(work, "ucm.yaml")],
                           stdout=log, stderr=subprocess.STDOUT, env=env)
    ctx = mp.get_context("spawn")
    procs: dict[int, Any] = {}
    killed: set[int] = set()
    res: dict[str, Any] = {"seed": seed, "minutes": minutes, "clients": clients, "block_bytes": list(sizes),
                           "dram_bytes": dram_mb << 20, "nvme_bytes": nvme_mb << 20}
    probe = None
    try:
        probe = _wait_ready(sock, svc)
        time.sleep(0.5)  # let the service settle (threads, first allocations) before the baseline
        rss = [_rss_kib(svc.pid)]
        fds_start = _fds(svc.pid)
        shm_start = _files(shm)
        shm_max = len(shm_start)
        next_idx = 0

        def start_client() -> None:
            nonlocal next_idx
            p = ctx.Process(target=client_main, args=(next_idx, sock, work, rnd.randrange(1 << 31), sizes, chains,
                                                      max_chain), daemon=True)
            p.start()
            procs[next_idx] = p
            next_idx += 1

        for _ in range(clients):
            start_client()
        t0 = time.monotonic()
        end = t0 + minutes * 60
        next_kill = t0 + rnd.uniform(0.5, 1.5) * kill_every_s if kill_every_s > 0 else float("inf")
        crashed = 0
        clock = bar(total=round(minutes * 60), desc="bench soak", unit="s")
        shown = 0
        while time.monotonic() < end:
            time.sleep(0.2)
            elapsed = min(round(minutes * 60), int(time.monotonic() - t0))
            if elapsed > shown:
                clock.update(elapsed - shown)
                clock.set_postfix_str(f"{len(killed)} clients killed")
                shown = elapsed
            rss.append(_rss_kib(svc.pid))
            shm_max = max(shm_max, len(_files(shm)))
            if svc.poll() is not None:
                break
            for i, p in list(procs.items()):
                if p.exitcode is not None and i not in killed:
                    crashed += 1  # a client died on its own: an exception escaped, or worse
                    killed.add(i)
                    start_client()
            now = time.monotonic()
            if now >= next_kill:
                alive = [i for i, p in procs.items() if p.exitcode is None and i not in killed]
                if alive:
                    victim = rnd.choice(alive)
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    killed.add(victim)
                    start_client()
                next_kill = now + rnd.uniform(0.5, 1.5) * kill_every_s
        clock.close()
        res["run_s"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(work, "stop"), "w"):
            pass
        for p in procs.values():
            p.join(90)
            if p.exitcode is None:
                p.kill()
                p.join()
        res["service_alive"] = svc.poll() is None
        counts: Counter = Counter()
        errors: list[str] = []
        for i in procs:
            try:
                with open(os.path.join(work, f"client-{i}.json")) as f:
                    got = json.load(f)
            except (OSError, ValueError):
                continue  # killed before its first report
            counts.update(got["counts"])
            errors += got["errors"]
        res["client_crashes"] = crashed
        res["client_kills"] = len(killed) - crashed
        res["client_processes"] = len(procs)
        for k in ("store_ops", "load_ops", "lookup_ops", "blocks_verified", "bytes_verified", "wrong_bytes",
                  "wrong_blocks", "exceptions", "timeouts", "bad_lookups", "lookup_hits"):
            res[k] = counts.pop(k, 0)
        res["outcomes"] = {k: v for k, v in sorted(counts.items())}
        res["errors"] = errors[:10]
        if not res["service_alive"]:
            raise RuntimeError("ucm serve died during the soak")
        # Every client is gone: the service must hold nothing for them.
        deadline = time.monotonic() + 30
        while True:
            st = probe.stats()
            svc_st = st.get("service", {})
            if (svc_st.get("connections") == 1 and svc_st.get("leases") == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        res["connections_left"] = svc_st.get("connections", 0) - 1
        res["leases_left"] = svc_st.get("leases")
        dram = st["tiers"]["dram"]
        res["dram_blocks"] = dram["blocks"]
        res["dram_orphan_slots"] = dram.get("adapter", {}).get("blocks", dram["blocks"]) - dram["blocks"]
        # No slot lost: more fresh blocks than the arena holds all go in and come back exact.
        n = (dram_mb << 20) // sizes[0] + 8
        keys = [hashlib.blake2b(KEY_SALT + b"refill:%d" % i, digest_size=16).digest() for i in range(n)]
        stored = probe.store(keys, [payload(k, sizes[0]) for k in keys]).wait(120)
        outs = [bytearray(sizes[0]) for _ in keys]
        loaded = probe.load(keys, outs).wait(120)
        res["refill_ok"] = (stored == [Outcome.DONE] * n and loaded == [Outcome.DONE] * n
                            and all(bytes(o) == payload(k, sizes[0]) for k, o in zip(keys, outs)))
        rss.append(_rss_kib(svc.pid))
        res["fds_start"] = fds_start
        res["fds_end"] = _fds(svc.pid)
        samples = [r for r in rss if r is not None]
        res["rss_kib_start"], res["rss_kib_max"], res["rss_kib_end"] = samples[0], max(samples), samples[-1]
        res["shm_files_start"] = len(shm_start)
        res["shm_files_max"] = shm_max
        probe.close()
        probe = None
        svc.send_signal(signal.SIGTERM)
        svc.wait(60)
        res["service_exit"] = svc.returncode
        res["shm_files_left"] = _files(shm)
    finally:
        for p in procs.values():
            if p.exitcode is None:
                p.kill()
        if probe is not None:
            probe.close()
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        log.seek(0)
        tail = log.read().decode(errors="replace").splitlines()
        res["service_log_tracebacks"] = sum("Traceback" in ln for ln in tail)
        res["service_log_tail"] = tail[-5:]
        log.close()
        for d in (work, shm, nvme):
            shutil.rmtree(d, ignore_errors=True)
    res["ok"] = bool(res.get("service_alive") and res["wrong_bytes"] == 0 and res["exceptions"] == 0
                     and res["timeouts"] == 0 and res["bad_lookups"] == 0 and res["client_crashes"] == 0
                     and res["leases_left"] == 0 and res["connections_left"] == 0
                     and res["dram_orphan_slots"] == 0 and res["refill_ok"]
                     and res["fds_end"] is not None and res["fds_end"] <= res["fds_start"]
                     and res["shm_files_left"] == [] and res["service_exit"] == 0)
    return res


def _table(res: dict[str, Any]) -> str:
    rows = [
        ("run", f"{res['run_s']} s, {res['clients']} clients, seed {res['seed']}"),
        ("operations", f"store {res['store_ops']}  load {res['load_ops']}  lookup {res['lookup_ops']}"),
        ("outcomes", "  ".join(f"{k} {v}" for k, v in res["outcomes"].items())),
        ("blocks verified", f"{res['blocks_verified']} ({res['bytes_verified'] / 1e9:.3f} GB)"),
        ("wrong bytes", f"{res['wrong_bytes']} in {res['wrong_blocks']} blocks"),
        ("exceptions into clients", f"{res['exceptions']}  (timeouts {res['timeouts']}, bad lookups "
                                    f"{res['bad_lookups']}, crashed clients {res['client_crashes']})"),
        ("client kills survived", f"{res['client_kills']} ({res['client_processes']} client processes)"),
        ("service RSS MiB", f"start {res['rss_kib_start'] / 1024:.1f}  max {res['rss_kib_max'] / 1024:.1f}  "
                            f"end {res['rss_kib_end'] / 1024:.1f}"),
        ("service fds", f"start {res['fds_start']}  end {res['fds_end']}"),
        ("arena dir files", f"start {res['shm_files_start']}  max {res['shm_files_max']}  "
                            f"left after exit {len(res['shm_files_left'])}"),
        ("left after clients", f"leases {res['leases_left']}  connections {res['connections_left']}  "
                               f"orphan dram slots {res['dram_orphan_slots']}  refill ok {res['refill_ok']}"),
        ("ok", str(res["ok"])),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{a.ljust(w)}  {b}" for a, b in rows]
    lines += [f"error: {e.strip().splitlines()[-1]}" for e in res["errors"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        kb = [int(x) for x in args.block_kb.split(",")]
    except ValueError:
        kb = []
    if len(kb) != 2 or min(kb) <= 0 or max(kb) > 1000:
        raise ArgumentError(f"--block-kb: two sizes in KiB below the 1 MiB region, like 64,200; got {args.block_kb!r}")
    res = soak(args.minutes, clients=args.clients, kill_every_s=args.kill_every_s, dram_mb=args.dram_mb,
               nvme_mb=args.nvme_mb, sizes=(kb[0] << 10, kb[1] << 10), chains=args.chains,
               max_chain=args.max_chain, seed=args.seed)
    common.report(res, args.json, _table, sort_keys=True)
    return 0 if res["ok"] else 1
