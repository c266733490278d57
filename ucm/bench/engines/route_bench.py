"""`ucm bench route`: KV-aware routing across two engines with NVIDIA
Dynamo 1.6.1's router, with and without ucm's tier events.

Two nodes, each a vLLM-CPU OpenAI server with ucm's connector over a ucm
service of its own (DRAM over NVMe), with a KV space smaller than the
working set; the demo's workload (documents asked again, chats whose turns
grow) with more documents, sent one at a time in arrival order through
Dynamo's frontend (ucm/bench/engines/dynamo_cluster.py). The same requests
through:
- `round_robin`: `--router-mode round-robin`;
- `kv_engine_events`: the KV router, the engines' own KV events only (ucm's
  catalog off: `events.enabled: false`);
- `kv_ucm_events`: the KV router with ucm's tier events;
- `shared_service`: as kv_ucm_events, both engines on one ucm service.
The variants run side by side, as many at once as memory allows (about
6.5 GiB each; three on a 24 GiB machine), each request sent to each of
them in turn: this machine's speed drifts by tens of percent over minutes,
and side by side the drift falls on every variant alike (`side_by_side` in
the JSON says which ran together). Each engine serves one request of its
own before the measured ones. A single engine without ucm serves the
reference outputs. Everything runs
in a loopback-only network namespace (Dynamo's event plane binds every
interface), which needs root; without it the bench says so and exits 1.

Reported per variant: TTFT p50/p90 per request class and overall, the sum
of TTFTs and of the repeats' (requests whose prefix an earlier request
computed), prompt tokens by source (vLLM's prefix cache, ucm DRAM, ucm
NVMe, computed), which node served each request, `repeats_to_holder` (of
the repeats whose prefix one node's ucm held further than the other's, the
share sent there), and whether outputs equal the reference's. Each session
starts with a 32-token tag of its own (users of different tenants; without
it, `--shared-prefix`, every document shares the demo's system prompt and a
KV router sends every request to the one node that holds it).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ucm.apps.demo.workload import CHAT_NEXT, DOC_AGAIN
from ucm.bench import common

REPEATS = (DOC_AGAIN, CHAT_NEXT)  # the workload's classes whose prefix an earlier request computed

VARIANTS = ("round_robin", "kv_engine_events", "kv_ucm_events", "shared_service")
SETTLE_S = 0.5  # a pause before each request: what served the last one (engines, their stores) goes idle first
GIB_PER_VARIANT = 6.5  # two engines, their services, Dynamo's frontend and workers (5.5 measured here), a margin
PAGE = 128  # vLLM for CPU's page, and the nodes' ucm block (as the demo's: its token accounting is per page)


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "route", help="KV-aware routing across two vLLM+ucm nodes with Dynamo's router: round "
                                        "robin, engine events, ucm's tier events, a shared service",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_json_flag(p, "print one JSON object (every row, the summary)")
    p.add_argument("--quick", action="store_true", help="a reduced run: few short requests, a tiny KV space")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--docs", type=int, default=None, help="documents of the workload (default 12; quick 3)")
    p.add_argument("--chats", type=int, default=None, help="chat sessions of the workload (default 3; quick 2)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per request (default 8)")
    p.add_argument("--engine-pages", type=int, default=None,
                   help="each engine's KV space in pages of 128 tokens (default: 1.5 longest prompts)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model and KV dtype")
    p.add_argument("--plot", default="out/route_ttft.png", help="PNG written here (default out/route_ttft.png)")
    p.add_argument("--work", default=None, help="directory for the logs (default: a new temporary one)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="keep the demo's system prompts shared by every session (default: a tag per session)")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the namespace


def run(args: argparse.Namespace) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        print(f"ucm bench route: --variants: unknown {bad}; allowed: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.inside:
        return _measure(args, variants)
    if os.geteuid() != 0:
        print("ucm bench route: needs root, to run Dynamo's router in a loopback-only network namespace "
              "(ip netns add)", file=sys.stderr)
        return 1
    if shutil.which("ip") is None:
        print("ucm bench route: needs `ip` (iproute2) for its loopback-only network namespace", file=sys.stderr)
        return 1
    args.plot = str(Path(args.plot).resolve())
    name = f"ucm-route-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        print(f"ucm bench route: cannot create a network namespace: {made.stderr.strip()}", file=sys.stderr)
        return 1
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        cmd = [sys.executable, "-m", "ucm.cli", "bench", "route", *_flags(args), "--inside"]
        return subprocess.run(["ip", "netns", "exec", name, *cmd]).returncode
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _flags(args: argparse.Namespace) -> list[str]:
    """The command line of `args`, for the run inside the namespace."""
    out = [f"--{flag.replace('_', '-')}" for flag in ("json", "quick", "shared_prefix") if getattr(args, flag)]
    for name in ("variants", "docs", "chats", "max_tokens", "engine_pages", "dtype", "plot", "work"):
        v = getattr(args, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    return out


def _measure(args: argparse.Namespace, variants: list[str]) -> int:
    from transformers import AutoTokenizer

    from ucm.apps.demo.report import machine_line, plot, summarize, table
    from ucm.apps.demo.workload import QUICK, WorkloadSpec, build_workload
    from ucm.apps.model import prepare

    log = common.progress_log(args.json)
    model = str(prepare("smollm2"))
    spec = dataclasses.replace(QUICK if args.quick else WorkloadSpec(), docs=args.docs or (3 if args.quick else 12),
                               chats=args.chats or (2 if args.quick else 3))
    requests = build_workload(AutoTokenizer.from_pretrained(model), spec)
    if not args.shared_prefix:  # users of different tenants: sessions share no prefix (see the module docstring)
        requests = _tagged(requests)
    classes = {r.index: r.cls for r in requests}
    longest = max(len(r.prompt) for r in requests)
    pages = args.engine_pages or int(1.5 * -(-longest // PAGE))
    distinct = len({tuple(r.prompt[:(b + 1) * PAGE]) for r in requests for b in range(len(r.prompt) // PAGE)})
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ucm-route-"))
    geometry = {"engine_pages": pages, "dram_blocks": max(4, distinct // 4), "nvme_blocks": 2 * distinct}
    log(f"machine: {machine_line()}\n{len(requests)} requests, longest {longest} tokens, {distinct} distinct blocks; "
        f"per node: {geometry}; logs in {work}")
    groups = _side_by_side(variants)
    if not groups:
        print(f"ucm bench route: one variant needs about {GIB_PER_VARIANT} GiB of memory, "
              f"{_available_gib():.1f} GiB are available", file=sys.stderr)
        return 1
    log(f"variants side by side: {groups}")
    runs = [_reference(work / "reference", model, requests, args, longest, pages, log)]
    for group in groups:
        runs += _variants(group, work, model, requests, args, geometry, longest, log)
    summary = summarize(runs, classes)
    result = _result(runs, summary, requests, geometry, machine_line())
    result["side_by_side"] = groups
    note = plot(runs, classes, summary, Path(args.plot).resolve(),
                f"ucm bench route: {len(requests)} requests over two vLLM-CPU + ucm nodes behind Dynamo 1.6.1")
    result["plot"] = note or str(Path(args.plot).resolve())
    common.report(result, args.json, lambda r: table(summary) + "\n\n" + _routing_table(r))
    return 0


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        kib = next((int(line.split()[1]) for line in f if line.startswith("MemAvailable:")), 0)
    return kib / (1 << 20)


def _side_by_side(variants: list[str]) -> list[list[str]]:
    """The variants in groups of as many as this machine's memory runs at
    once (see `_variants`), in the order given; none if not even one fits."""
    size = int(_available_gib() // GIB_PER_VARIANT)
    return [variants[i:i + size] for i in range(0, len(variants), size)] if size else []


def _tagged(requests: list) -> list:
    """Each session's prompts behind a tag of its own (32 token ids seeded by
    the session's name): without it every document shares the demo's system
    prompt, and a KV router sends every request to the node that holds it."""
    import random

    tags: dict = {}
    out = []
    for r in requests:
        tag = tags.setdefault(r.session, [random.Random(r.session).randrange(1000, 40000) for _ in range(32)])
        out.append(dataclasses.replace(r, prompt=tag + r.prompt))
    return out


def _reference(work: Path, model: str, requests: list, args: argparse.Namespace, longest: int, pages: int,
               log) -> dict:
    """One engine without ucm (as the nodes' engines, its own prefix cache
    on): the outputs every variant must equal."""
    from ucm.bench.engines.dynamo_cluster import RoutedCluster

    log("reference: one engine, no ucm")
    with RoutedCluster(work, model, nodes=1, ucm=False, dynamo=False, engine_pages=pages, dtype=args.dtype,
                       max_model_len=longest + args.max_tokens + 64) as c:
        _warm(c)
        rows = []
        for r in requests:
            time.sleep(SETTLE_S)
            rows.append(_row(c, r, args.max_tokens, node=1))
    return {"name": "reference", "rows": rows}


def _variants(names: list[str], work: Path, model: str, requests: list, args: argparse.Namespace, geometry: dict,
              longest: int, log) -> list[dict]:
    """Every variant's cluster at once, each request sent to each of them in
    turn (the order rotating from request to request): the machine's speed
    drifts by tens of percent over minutes here, and side by side the drift
    falls on every variant alike."""
    from contextlib import ExitStack

    from ucm.bench.engines.dynamo_cluster import RoutedCluster

    with ExitStack() as stack:
        clusters = []
        for k, name in enumerate(names):
            log(f"{name}: starting two nodes and Dynamo")
            clusters.append(stack.enter_context(RoutedCluster(
                work / name, model, router_mode="round-robin" if name == "round_robin" else "kv",
                ucm_events=name != "kv_engine_events", shared_service=name == "shared_service", block_tokens=PAGE,
                dtype=args.dtype, max_model_len=longest + args.max_tokens + 64, port_base=20 * k,
                namespace=f"ucm{k}", **geometry)))
        for c in clusters:
            _warm(c)
        rows: dict[str, list[dict]] = {name: [] for name in names}
        for r in requests:
            for j in range(len(names)):
                k = (r.index + j) % len(names)
                c, name = clusters[k], names[k]
                looked = {n: c.lookup(n, r.prompt) for n in (1, 2)}  # (leading blocks held, tier per block)
                held = [looked[n][0] for n in (1, 2)]
                holders = [n for n in (1, 2) if held[n - 1] == max(held)] if max(held) > min(held) else []
                time.sleep(SETTLE_S)
                rows[name].append(_row(c, r, args.max_tokens, holders=holders,
                                       tiers={n: looked[n][1] for n in (1, 2)}))
                log(f"{name}: {r.index + 1}/{len(requests)} {r.cls}: node {rows[name][-1]['node']} "
                    f"{rows[name][-1]['ttft_s'] * 1000:.0f} ms")
    return [{"name": name, "rows": rows[name]} for name in names]


def _warm(c) -> None:
    """One request of its own to each engine and one through the frontend,
    not measured: a fresh engine's first forward pays one-time costs
    (kernels, allocations) that no variant should carry into its numbers."""
    import random

    prompt = [random.Random(f"warm-up {n}").randrange(1000, 40000) for n in range(2 * PAGE + 7)]
    for n in range(1, c.nodes + 1):
        c.ask([n, *prompt], 2, node=n)
    if c.dynamo:
        c.ask([0, *prompt], 2)


def _row(c, req, max_tokens: int, node: Optional[int] = None, holders: Optional[list[int]] = None,
         tiers: Optional[dict] = None) -> dict:
    """One request through the frontend (or straight to `node`); `tiers`:
    per node, where its ucm held each of the prompt's blocks just before."""
    from ucm.apps.demo.engine import nvme_share

    nodes = [node] if node is not None else list(range(1, c.nodes + 1))
    before = {n: c.counters(n) for n in nodes}
    tiers = tiers or {}
    got = c.ask(req.prompt, max_tokens, node=node)
    after = {n: c.counters(n) for n in nodes}
    served = next((n for n in nodes if after[n]["prompt"] > before[n]["prompt"]), nodes[0])
    engine = int(after[served]["engine"] - before[served]["engine"])
    ucm = int(after[served]["ucm"] - before[served]["ucm"])
    nvme = nvme_share(engine, ucm, tiers.get(served, []))
    return {"index": req.index, "cls": req.cls, "prompt_tokens": len(req.prompt), "ttft_s": got["ttft_s"],
            "wall_s": got["wall_s"], "tokens": got["text"], "node": served, "holders": holders or [],
            "engine_tokens": engine, "ucm_tokens": ucm, "ucm_dram_tokens": ucm - nvme, "ucm_nvme_tokens": nvme}


def _result(runs: list[dict], summary: dict, requests: list, geometry: dict, machine: str) -> dict:
    ref = {r["index"]: r["tokens"] for r in runs[0]["rows"]}
    variants = {}
    for run, s in zip(runs[1:], summary["runs"][1:]):
        rows = run["rows"]
        repeats = [r for r in rows if r["cls"] in REPEATS]
        held = [r for r in repeats if r["holders"]]
        variants[run["name"]] = {
            "ttft_sum_s": sum(r["ttft_s"] for r in rows),
            "repeat_ttft_sum_s": sum(r["ttft_s"] for r in repeats),
            "ttft_p50_s": s["ttft_s"]["all"]["p50"], "ttft_p90_s": s["ttft_s"]["all"]["p90"],
            "ttft_by_class_s": {k: v for k, v in s["ttft_s"].items() if k != "all"},
            "repeats_to_holder": (sum(1 for r in held if r["node"] in r["holders"]) / len(held)) if held else None,
            "repeats_with_a_holder": len(held), "repeats": len(repeats),
            "tokens": s["tokens"], "outputs_equal": sum(1 for r in rows if r["tokens"] == ref.get(r["index"])),
            "rows": rows,
        }
    equal = all(v["outputs_equal"] == len(requests) for v in variants.values())
    return {"machine": machine, "requests": len(requests), "geometry": geometry, "outputs_equal": equal,
            "variants": variants, "reference": runs[0]["rows"]}


def _routing_table(r: dict) -> str:
    lines = [f"{'routing':<20}{'repeats to holder':>20}{'repeat TTFT sum (s)':>22}{'TTFT sum (s)':>14}"]
    for name, v in r["variants"].items():
        share = "-" if v["repeats_to_holder"] is None else \
            f"{v['repeats_to_holder'] * 100:.0f}% of {v['repeats_with_a_holder']}"
        lines.append(f"{name:<20}{share:>20}{v['repeat_ttft_sum_s']:>22.2f}{v['ttft_sum_s']:>14.2f}")
    lines.append(f"outputs equal to the reference: {r['outputs_equal']}; plot: {r['plot']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(common.main("python -m ucm.bench.engines.route_bench", __doc__, _add_args, run))
