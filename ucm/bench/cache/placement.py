"""`ucm bench placement`: the cost of placement decisions per block.

Drives the placement engine (the metadata half of UnifiedCache, no payload bytes)
with the cache's call pattern over two tiers (DRAM over NVMe) kept full, so
that every stored block evicts one from DRAM, demotes it to NVMe, and evicts
one from NVMe in turn. Per request, in one lock hold of the cache:
`record_request(keys)`, `lookup`, the missing blocks stored, `touch(keys)`.
Two ways of storing the missing blocks, measured in the same run over the
same requests:
- `per_block`: one `insert(key, parent, size)` per block, the cache's
  call pattern before the batched calls;
- `batched`: one `insert_run(keys, parent, sizes)` for the whole run.
Both must make the same decisions (`same_decisions` compares the tiers'
counters and contents afterwards).

Each is measured on both placement engines: `python` (ucm/placement/engine.py
with the Python policy) and, for a policy with a native twin, `native` (the
C++ core, ucm/placement/native.py); the same decisions are required across
engines too. `per_block_us_per_block` and `batched_us_per_block` are the
figures of the engine `make_placement` picks by default (native where there is
one).

Workload (seeded, the same for every policy): requests of
`blocks_per_request` blocks; a third of them continue the first half of an
earlier request (a hit prefix, then new blocks behind it), the rest are new.
DRAM holds 2 requests' blocks, NVMe 8. The tiers are filled first
(`warmup`), then `blocks` blocks' worth of requests are timed; the figure
is CPU time of the calling thread per recorded block (µs; CPU time, so
that other load on the machine does not count, and of this thread, so that
helper threads of imported libraries, such as OpenBLAS's spinning workers
once numpy is loaded, do not either), the median over `--repeat` runs;
the cycle collector runs once before the timed part, so that it starts with
no young objects of the setup (the collector stays on while timing).
Runs in the calling process, single-threaded; figures on a busy machine
are noisy (take the median of several repeats).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Sequence

from ucm.bench import common
from ucm.errors import ArgumentError
from ucm.placement import PlacementEngine, TierSpec
from ucm.placement import make_placement as make_engine  # this module's make_placement builds the bench's tiers
from ucm.placement.heat import HeatTracker, Key
from ucm.placement.policies.base import load_policy, policy_names
from ucm.progress import bar

BLOCK_BYTES = 1 << 20  # nominal; only the ratio to the capacities matters
DRAM_REQUESTS = 2  # DRAM capacity, in requests' blocks
NVME_REQUESTS = 8
REUSE_SHARE = 1 / 3
PATHS = ("per_block", "batched")
ENGINES = ("python", "native")


def workload(blocks_per_request: int, requests: int, seed: int = 0) -> list[list[Key]]:
    """`requests` requests' keys: a third continue half of an earlier one."""
    rnd = random.Random(seed)
    out: list[list[Key]] = []
    counter = 0
    for _ in range(requests):
        keys: list[Key] = []
        if out and rnd.random() < REUSE_SHARE:
            old = out[max(0, len(out) - rnd.randint(1, NVME_REQUESTS))]
            keys = old[:blocks_per_request // 2]
        while len(keys) < blocks_per_request:
            counter += 1
            keys.append(counter.to_bytes(16, "little"))
        out.append(keys)
    return out


def make_placement(policy: str, blocks_per_request: int, engine: str = "auto") -> PlacementEngine:
    specs = [TierSpec("dram", DRAM_REQUESTS * blocks_per_request * BLOCK_BYTES),
             TierSpec("nvme", NVME_REQUESTS * blocks_per_request * BLOCK_BYTES)]
    return make_engine(specs, load_policy(policy), heat=HeatTracker(), engine=engine)


def has_native(policy: str) -> bool:
    """Whether `policy` runs on the native core by default."""
    return make_placement(policy, 1).native


def _request(p: PlacementEngine, keys: Sequence[Key], batched: bool) -> None:
    p.record_request(keys)
    n = p.lookup(keys)
    parent = keys[n - 1] if n else None
    todo = keys[n:]
    if batched:
        p.insert_run(todo, parent, [BLOCK_BYTES] * len(todo))
    else:
        for k in todo:
            if not p.insert(k, parent, BLOCK_BYTES).placed:
                break
            parent = k
    p.touch(keys)


def _state(p: PlacementEngine) -> list:
    return [(p.counters(t), sorted(p.resident_keys(t))) for t in range(p.tier_count)]


def measure(policy: str, blocks_per_request: int, blocks: int, seed: int = 0) -> dict:
    """One run of both paths on each engine the policy has: µs per block
    each (keys `<engine>_<path>`), and whether they all agree."""
    warm = (DRAM_REQUESTS + NVME_REQUESTS) * 2 + 2  # requests until both tiers are full and churning
    timed = max(1, blocks // blocks_per_request)
    reqs = workload(blocks_per_request, warm + timed, seed)
    out: dict = {}
    states = []
    engines = ENGINES if has_native(policy) else ENGINES[:1]
    for engine in engines:
        for path in PATHS:
            batched = path == "batched"
            p = make_placement(policy, blocks_per_request, engine=engine)
            for keys in reqs[:warm]:
                _request(p, keys, batched)
            gc.collect()  # the setup's young objects (workload, tracker) not traversed in the timed part
            t0 = time.thread_time()
            for keys in reqs[warm:]:
                _request(p, keys, batched)
            elapsed = time.thread_time() - t0
            out[f"{engine}_{path}"] = elapsed * 1e6 / (timed * blocks_per_request)
            out[f"{engine}_{path}_evictions"] = sum(p.counters(t).evictions for t in range(p.tier_count))
            states.append(_state(p))
    out["same_decisions"] = all(s == states[0] for s in states)
    return out


def run(policies: Sequence[str], sizes: Sequence[int], blocks: int, repeat: int,
        seed: int = 0) -> dict:
    """The bench's JSON document."""
    rows = []
    steps = bar(total=len(policies) * len(sizes), desc="bench placement", unit="step")
    for policy in policies:
        for bpr in sizes:
            steps.set_postfix_str(f"{policy}, {bpr} blocks/request")
            runs = [measure(policy, bpr, blocks, seed) for _ in range(repeat)]
            steps.update(1)
            native = "native_batched" in runs[0]
            row = {"policy": policy, "blocks_per_request": bpr,
                   "timed_requests": max(1, blocks // bpr),
                   "dram_blocks": DRAM_REQUESTS * bpr, "nvme_blocks": NVME_REQUESTS * bpr,
                   "native": native}
            for engine in ENGINES:
                for path in PATHS:
                    k = f"{engine}_{path}"
                    row[f"{k}_us_per_block"] = (round(statistics.median(r[k] for r in runs), 3)
                                                if k in runs[0] else None)
            default = "native" if native else "python"
            for path in PATHS:
                row[f"{path}_us_per_block"] = row[f"{default}_{path}_us_per_block"]
            row["speedup"] = round(row["per_block_us_per_block"] / max(row["batched_us_per_block"], 1e-9), 2)
            row["native_speedup"] = (round(row["python_batched_us_per_block"]
                                           / max(row["native_batched_us_per_block"], 1e-9), 2) if native else None)
            row["evictions"] = runs[0][f"{default}_batched_evictions"]
            row["same_decisions"] = all(r["same_decisions"] for r in runs)
            rows.append(row)
    steps.close()
    return {"bench": "placement", "unit": "us_per_block", "repeat": repeat,
            "blocks_timed": blocks, "results": rows}


def format_table(doc: dict) -> str:
    lines = ["| policy | blocks/request | python per-block (µs/block) | python batched | native per-block "
             "| native batched | native speedup | same decisions |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]

    def cell(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    for r in doc["results"]:
        lines.append(f"| {r['policy']} | {r['blocks_per_request']} | {cell(r['python_per_block_us_per_block'])} "
                     f"| {cell(r['python_batched_us_per_block'])} | {cell(r['native_per_block_us_per_block'])} "
                     f"| {cell(r['native_batched_us_per_block'])} | {cell(r['native_speedup'], '{:.2f}x')} "
                     f"| {r['same_decisions']} |")
    return "\n".join(lines)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(v <= 0 for v in out):
        raise ArgumentError(f"{flag} needs a comma list of integers > 0, got {text!r}")
    return out


def handle(args: argparse.Namespace) -> int:
    installed = policy_names()
    if args.policy == "all":
        policies = installed
    else:
        policies = [n.strip() for n in args.policy.split(",") if n.strip()]
        unknown = [n for n in policies if n not in installed]
        if unknown or not policies:
            raise ArgumentError(f"--policy: unknown {unknown or args.policy!r}; installed: {installed}")
    sizes = _int_list(args.blocks_per_request, "--blocks-per-request")
    if args.blocks <= 0 or args.repeat <= 0:
        raise ArgumentError(f"--blocks and --repeat must be > 0, got {args.blocks} and {args.repeat}")
    if args.service_seconds <= 0 or args.service_clients <= 0:
        raise ArgumentError(f"--service-seconds and --service-clients must be > 0, got "
                            f"{args.service_seconds} and {args.service_clients}")
    if args.baseline is not None and not args.service:
        raise ArgumentError("--baseline names the tree whose service --service measures: give --service too")
    doc = run(policies, sizes, args.blocks, args.repeat, args.seed)
    if args.service:
        from ucm.bench.cache import staging

        doc["service"] = staging.run(args.baseline, clients=args.service_clients, seconds=args.service_seconds,
                                     repeat=args.repeat)
    common.report(doc, args.json, _tables)
    return 0


def _tables(doc: dict) -> str:
    """The placement table, and the service's when it was measured."""
    return "\n".join([format_table(doc), *([format_service(doc["service"])] if "service" in doc else [])])


def format_service(doc: dict) -> str:
    """The service half (`--service`) as a table."""
    lines = [f"stores and lookups through ucm serve, {doc['clients']} clients x {doc['blocks_per_store']} "
             f"blocks of {doc['block_bytes'] // 1024} KiB, {doc['seconds']} s per phase",
             "| tree | stores/s alone | stores/s while one client stages | ratio | lookups/s while staging "
             "| staged blocks/s |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("current", "baseline"):
        r = doc.get(name)
        if r is None:
            continue
        a, w = r["alone"], r["with_staging"]
        lines.append(f"| {r.get('tree', 'this one')} | {a['stores_per_s']:.0f} | {w['stores_per_s']:.0f} "
                     f"| {r['store_ratio']:.2f} | {w['lookups_per_s']:.0f} | {w['staged_blocks_per_s']:.0f} |")
    return "\n".join(lines)


def register(subparsers: common.Subparsers) -> None:
    common.add_bench(
        subparsers, "placement", help="placement cost per block, batched calls against per-block calls",
        description=__doc__.split("\n\n")[0],
        epilog=("Output: a table, or with --json one object with `results`, one row per policy and "
                "request size: python_/native_ per_block/batched _us_per_block (native: null without a "
                "native twin), per_block_us_per_block and batched_us_per_block of the default engine, "
                "speedup, native_speedup, evictions, same_decisions. Example: ucm bench placement --policy all "
                "--blocks-per-request 16,512 --repeat 3 --json"),
        add_args=_add_args, handler=handle, raw_description=False)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="all", metavar="NAME[,NAME...]",
                   help="policies to measure, or 'all' (default: every installed `ucm.policies` entry point)")
    p.add_argument("--blocks-per-request", default="16,512", metavar="N[,N...]",
                   help="request sizes in blocks (default 16,512)")
    p.add_argument("--blocks", type=int, default=8192, metavar="N",
                   help="blocks timed per policy, size and path after the warm-up (default 8192)")
    p.add_argument("--repeat", type=int, default=3, metavar="N",
                   help="runs per figure; the median is reported (default 3; --service: runs per tree)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--service", action="store_true",
                   help="also measure stores and lookups per second through `ucm serve` with "
                        "--service-clients clients, alone and while one more client stages from NVMe "
                        "(ucm/bench/cache/staging.py; JSON key `service`)")
    p.add_argument("--service-clients", type=int, default=4, metavar="N", help="store clients (default 4)")
    p.add_argument("--service-seconds", type=float, default=4.0, metavar="S",
                   help="seconds per phase (default 4)")
    p.add_argument("--baseline", metavar="DIR",
                   help="with --service: the source tree of another ucm version (a git worktree with its "
                        "native module built in place) measured in the same run, e.g. the commit before")
    common.add_json_flag(p, "print one JSON object instead of a table")
