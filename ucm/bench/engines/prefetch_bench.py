"""`ucm bench prefetch`: what the vLLM connector's prefetch policies buy
under a queue (vLLM for CPU, the model of `--model`).

`--requests` requests, each over its own document of a length drawn from
`--doc-tokens LO,HI` (deterministic pseudo-random token ids, as in `ucm
bench vllm`) plus a short question; 8 greedy tokens each. Their KV is
stored through ucm first (a cold pass with the connector) and then pushed
to NVMe only (filler stores until `locate` reports every document block
below DRAM); the DRAM tier holds 40 % of the documents' blocks, so they
cannot all stay there. vLLM runs with `--max-num-seqs` (2) so that
requests queue. Two arrival patterns: a burst (all at t=0) and a Poisson
stream (seeded, `--rate` requests/s). Requests go to vLLM's AsyncLLM at
their arrival time, streaming: TTFT = time of the first streamed output
minus the arrival.

Variants, each in a fresh engine in its own subprocess (ucm/bench/engines/prefetch_variant.py),
same thread binding:
- `no_ucm`: no connector, vLLM's prefix cache on (reset between patterns:
  cold). It is also the reference: its outputs are the cached-length-0
  reference, and afterwards every prompt is asked again so that vLLM's own
  prefix cache hits it (the full-hit reference);
- `all_in_dram`: ucm over a DRAM tier large enough for every document
  (the bound); its engine makes the cold store pass, whose blocks are then
  copied into the small-DRAM service of the other variants;
- `ucm_off`, `best_effort`, `wait_complete`, `timeout`: ucm, small DRAM,
  `ucm_prefetch_policy` as named, `ucm_load_streaming` off; documents pushed
  back to NVMe only before every pattern;
- `streaming`: as `ucm_off` with `ucm_load_streaming` auto: the NVMe hits
  are streamed layer by layer under the forward instead of loaded
  asynchronously;
- `accelerator`: policy `off` with the YAML `prefetch` accelerator on (its
  own service, same sizes, the blocks copied in): the service stages every
  request's NVMe blocks on first sight (`begin_request`), unbounded by the
  connector's waiting-pin cap; its counters give `prefetch_wasted_bytes`.
vLLM's prefix cache is off in the ucm variants (every reused token comes
from ucm). The accelerator is off in the policy variants: their own
staging (the connector's `CacheAPI.prefetch` of a waiting request's pinned
hit) is what they measure, and the two would stage the same blocks twice;
their `prefetch_wasted_bytes` is null (no counter sees it).

Per variant and pattern: TTFT p50/p90/p99 and mean; `io_blocked_s` (sum
over requests, measured in the connector by ucm.bench.engines.prefetch_probe: the
time a request was answered `None` while its staging ran, plus the time an
asynchronous load held its pages); NVMe bytes read (the nvme adapter's
`bytes_read`) and blocks promoted into DRAM; `outputs_equal`: every
request's 8 tokens equal the reference with the same cached length
(0: no_ucm's; the full hit: vLLM's prefix-cache hit); requests whose cached
length matches neither are listed in `unchecked`, not compared.
`--quick`: 4 requests of ~1K tokens, the burst only, variants no_ucm and
wait_complete (its engine then makes the store pass itself).
Environment defaults as `ucm bench vllm` (VLLM_CPU_KVCACHE_SPACE=1,
VLLM_CPU_OMP_THREADS_BIND=0-(cores-1), offline).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from ucm.apps.demo.run import DTYPE_BYTES, page_bytes
from ucm.apps.engine_env import bench_env, run_spec
from ucm.bench import common
from ucm.bench.engines.ttft_workload import QUESTIONS, WARM_TOKENS, vocabulary
from ucm.bench.engines.vllm_engine import BLOCK_TOKENS

GEN_TOKENS = 8
VARIANTS = ("no_ucm", "all_in_dram", "ucm_off", "streaming", "accelerator", "best_effort", "wait_complete",
            "timeout")
POLICY = {"all_in_dram": "off", "ucm_off": "off", "streaming": "off", "accelerator": "off",
          "best_effort": "best_effort", "wait_complete": "wait_complete", "timeout": "timeout"}
# `ucm_load_streaming` per variant: only `streaming` streams its NVMe hits
# under the forward; the others load them asynchronously (or stage them).
STREAMING = {"streaming": "auto"}
PATTERNS = ("burst", "poisson")
DRAM_SHARE = 0.4
CONFIG_TAG = {"all_in_dram": "big", "accelerator": "accel"}  # the service of each ucm variant (else "small")


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "prefetch", help="TTFT under a queue: no ucm, ucm without prefetch, each prefetch policy, "
                                           "all in DRAM", description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=16, help="requests, one document each (default 16)")
    p.add_argument("--doc-tokens", default="3000,6000", help="document length range LO,HI (default 3000,6000)")
    p.add_argument("--max-num-seqs", type=int, default=2, help="vLLM max_num_seqs (default 2)")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second (default 4.0)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--patterns", default=",".join(PATTERNS), help="comma list of burst,poisson")
    common.add_model_flag(p)
    p.add_argument("--quick", action="store_true", help="4 requests of ~1K tokens, burst, no_ucm + wait_complete")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                   help="model and KV dtype (default bfloat16; float32 is faster on a CPU without AVX-512 BF16)")
    common.add_json_flag(p)


def _prompts(model: str, n: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab = vocabulary(tok)
    rng = random.Random(4321)
    q = tok.encode(QUESTIONS[0], add_special_tokens=False)
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(lo, hi))] + q for _ in range(n)]
    warm = [rng.choice(vocab) for _ in range(WARM_TOKENS)]
    return prompts, warm


def arrivals(pattern: str, n: int, rate: float, seed: int = 7) -> list[float]:
    """Arrival offsets in seconds: all 0 (burst), or a seeded Poisson stream
    starting at 0."""
    if pattern == "burst":
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 4))
        t += rng.expovariate(rate)
    return out


# ---- the driver ---------------------------------------------------------------
def _subprocess(spec: dict, work: Path) -> dict:
    return run_spec("ucm.bench.engines.prefetch_variant", spec, work, spec["variant"], f"variant {spec['variant']!r}")


def _ucm_config(work: Path, tag: str, dram_bytes: int, nvme_bytes: int, accelerator: bool = False) -> Path:
    import yaml

    (work / f"nvme-{tag}").mkdir()
    cfg = {
        "block_tokens": BLOCK_TOKENS,
        "tiers": [{"adapter": "dram", "capacity": f"{dram_bytes >> 20}MiB", "headroom": 0.2,
                   "options": {"path": "/dev/shm", "prefault": False}},
                  {"adapter": "nvme", "capacity": f"{nvme_bytes >> 20}MiB",
                   "options": {"path": str(work / f"nvme-{tag}"), "region_size": "16MiB", "direct_io": True}}],
        "policy": {"name": "lru"},
        "service": {"name": f"bench-prefetch-{tag}-{os.getpid()}", "socket": str(work / f"ucm-{tag}.sock")},
    }
    if accelerator:
        cfg["accelerators"] = [{"name": "prefetch"}]
    path = work / f"ucm-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _copy_blocks(src, dst, doc_keys: list[list[bytes]], block: int) -> int:
    """Every document's blocks from one service into another (its DRAM
    overflows to its NVMe); returns the blocks copied."""
    import numpy as np

    from ucm.api import Outcome

    copied = 0
    for ks in doc_keys:
        for i in range(0, len(ks), 8):
            chunk = ks[i:i + 8]
            bufs = [np.empty(block, dtype=np.uint8) for _ in chunk]
            res = src.load(chunk, bufs).wait(120) or []
            good = 0
            while good < len(chunk) and good < len(res) and res[good] is Outcome.DONE:
                good += 1
            if good:
                dst.store(chunk[:good], bufs[:good], parent=ks[i - 1] if i else None).wait(120)
                copied += good
            if good < len(chunk):
                break
    dst.flush()
    return copied


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 4)


def measure(requests: int, lo: int, hi: int, max_num_seqs: int, rate: float, variants: list[str],
            patterns: list[str], model_name: str = "smollm2", log=print, dtype: str = "bfloat16") -> dict[str, Any]:
    import ucm
    from ucm.apps.model import prepare

    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"--variants: {v!r} not one of {list(VARIANTS)}")
    for p in patterns:
        if p not in PATTERNS:
            raise ValueError(f"--patterns: {p!r} not one of {list(PATTERNS)}")
    if "no_ucm" not in variants:
        raise ValueError("--variants must include no_ucm (the reference outputs)")
    if requests < 1 or not 1 <= lo <= hi or max_num_seqs < 1 or rate <= 0:
        raise ValueError(f"bad workload: requests={requests} doc_tokens={lo},{hi} max_num_seqs={max_num_seqs} "
                         f"rate={rate}")
    os.environ.update({k: v for k, v in bench_env().items() if k not in os.environ})
    model = str(prepare(model_name))
    prompts, warm = _prompts(model, requests, lo, hi)
    doc_blocks = sum(len(p) // BLOCK_TOKENS for p in prompts)
    block = page_bytes(Path(model), dtype, BLOCK_TOKENS)
    total = doc_blocks * block
    largest = max(len(p) // BLOCK_TOKENS for p in prompts) * block
    dram_small = max(int(total * DRAM_SHARE), 2 * largest) + (8 << 20)
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-prefetch-"))
    small = _ucm_config(work, "small", dram_small, max(1 << 30, 4 * (total + dram_small)))
    big = _ucm_config(work, "big", 2 * total + (64 << 20), 1 << 30)
    accel = _ucm_config(work, "accel", dram_small, max(1 << 30, 4 * (total + dram_small)), accelerator=True)
    configs = {"small": small, "big": big, "accel": accel}
    arr = {p: arrivals(p, requests, rate) for p in patterns}
    base = {"model": model, "prompts": prompts, "warm": warm, "max_num_seqs": max_num_seqs, "patterns": patterns,
            "arrivals": arr, "work": str(work), "dtype": dtype, "block_bytes": block}
    res: dict[str, dict] = {}
    clients: dict[str, Any] = {}
    cwd = os.getcwd()
    os.chdir(work)  # private services are spawned as `python -m ucm.cli` here, away from a source checkout
    source: Optional[str] = None  # the service whose engine made the store pass
    try:
        for v in variants:
            log(f"[bench prefetch] {v} ...")
            spec = {**base, "variant": v}
            if v != "no_ucm":
                tag = CONFIG_TAG.get(v, "small")
                if tag not in clients:
                    clients[tag] = ucm.connect(str(configs[tag]))  # the private service outlives the engines
                    if not clients[tag].connected:
                        raise RuntimeError(f"could not start the ucm service ({tag})")
                    if source is not None:  # this service gets the documents' blocks from the first one
                        doc_keys = [[bytes.fromhex(k) for k in ks] for ks in res["_store"]["doc_keys"]]
                        copied = _copy_blocks(clients[source], clients[tag], doc_keys, block)
                        res["_store"]["copied_blocks"][tag] = copied
                spec.update(ucm_config=str(configs[tag]), push_to_nvme=(v != "all_in_dram"),
                            store_pass=source is None)
            res[v] = _subprocess(spec, work)
            if v != "no_ucm" and source is None:
                source = CONFIG_TAG.get(v, "small")
                res["_store"] = {"variant": v, "requests": res[v].get("store_pass"),
                                 "tiers": res[v].get("stored_tiers"), "doc_keys": res[v]["doc_keys"],
                                 "copied_blocks": {}}
    finally:
        for c in clients.values():
            c.close()
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    return {**summarize(res, variants, patterns, prompts, arr, max_num_seqs, rate, dram_small, total), "dtype": dtype}


def summarize(res: dict, variants: list[str], patterns: list[str], prompts: list[list[int]],
              arr: dict[str, list[float]], max_num_seqs: int, rate: float, dram_bytes: int,
              doc_bytes: int) -> dict[str, Any]:
    ref = res["no_ucm"]
    cold_ref = [r["tokens"] for r in ref["patterns"][patterns[0]]["requests"]]
    hit_ref = {i: (r["cached"], r["tokens"]) for i, r in enumerate(ref["apc_reference"])}
    out: dict[str, Any] = {
        "requests": len(prompts), "prompt_tokens": [len(p) for p in prompts], "max_num_seqs": max_num_seqs,
        "rate_per_s": rate, "arrivals_s": arr, "gen_tokens": GEN_TOKENS,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "dram_tier_bytes": dram_bytes, "doc_bytes": doc_bytes,
        "prefetch_accelerator": [v for v in variants if v == "accelerator"],
        "store_pass_variant": res.get("_store", {}).get("variant"), "store_pass": res.get("_store", {}).get("tiers"),
        "copied_blocks": res.get("_store", {}).get("copied_blocks") or None,
        "variants": {},
    }
    all_eq = True
    for v in variants:
        vr = res[v]
        out_v: dict[str, Any] = {}
        for p in patterns:
            rec = vr["patterns"][p]
            reqs = rec["requests"]
            ttft = [r["ttft_s"] for r in reqs]
            checked, unchecked, wrong = 0, [], []
            for i, r in enumerate(reqs):
                if r["cached"] == 0:
                    want = cold_ref[i]
                elif r["cached"] == hit_ref[i][0]:
                    want = hit_ref[i][1]
                else:
                    unchecked.append({"request": i, "cached": r["cached"], "full_hit": hit_ref[i][0]})
                    continue
                checked += 1
                if r["tokens"] != want:
                    k = next((j for j, (x, y) in enumerate(zip(r["tokens"], want)) if x != y), len(want))
                    wrong.append({"request": i, "cached": r["cached"], "first_diff": k, "tokens": r["tokens"],
                                  "reference": want})
            eq = not wrong and checked > 0
            all_eq = all_eq and eq
            probe = rec.get("probe") or {}
            row = {
                "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9), "ttft_p99_s": _pct(ttft, 0.99),
                "ttft_mean_s": round(statistics.mean(ttft), 4), "makespan_s": max(r["done_s"] for r in reqs),
                "io_blocked_s": (round(sum(x["staging_wait_s"] + x["async_load_s"] for x in probe.values()), 4)
                                 if v != "no_ucm" else None),
                "staging_wait_s": round(sum(x["staging_wait_s"] for x in probe.values()), 4) if probe else None,
                "async_load_s": round(sum(x["async_load_s"] for x in probe.values()), 4) if probe else None,
                "nvme_bytes_read": rec.get("service", {}).get("nvme_bytes_read"),
                "dram_promotions_in": rec.get("service", {}).get("dram_promotions_in"),
                "prefetch_wasted_bytes": (rec.get("service", {}).get("accelerator") or {}).get("bytes_wasted"),
                "accelerator": (rec.get("service", {}).get("accelerator") or None),
                "tiers_before": vr.get("tiers_before", {}).get(p),
                "cached_tokens": [r["cached"] for r in reqs],
                "outputs_equal": eq, "checked": checked, "unchecked": unchecked, "wrong": wrong,
                "ttft_s": ttft,
            }
            out_v[p] = row
        out["variants"][v] = out_v
    out["outputs_equal"] = all_eq
    ratios = {}
    for p in patterns:
        if "ucm_off" in out["variants"]:
            off = out["variants"]["ucm_off"][p]["ttft_p99_s"]
            ratios[p] = {f"{v}_p99_over_ucm_off": round(out["variants"][v][p]["ttft_p99_s"] / off, 3)
                         for v in variants if v != "ucm_off" and off > 0}
    out["ratios"] = ratios
    return out


def run(args: argparse.Namespace) -> int:
    def measured(log: common.Log) -> dict[str, Any]:
        if args.quick:
            requests, lo, hi = 4, 896, 1152
            variants, patterns = ["no_ucm", "wait_complete"], ["burst"]
        else:
            requests = args.requests
            lo, hi = (int(x) for x in args.doc_tokens.split(","))
            variants = [v for v in args.variants.split(",") if v]
            patterns = [p for p in args.patterns.split(",") if p]
        return measure(requests, lo, hi, args.max_num_seqs, args.rate, variants, patterns, args.model, log=log,
                       dtype=args.dtype)

    return common.run_measured(args, "prefetch", measured, table,
                               errors=(RuntimeError, ValueError, subprocess.TimeoutExpired))


def table(r: dict[str, Any]) -> str:
    """Per variant and pattern: TTFT percentiles, I/O wait, NVMe bytes read, outputs equal."""
    lines = [f"{'variant':14s} {'pattern':8s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'io_s':>7s} {'nvme_MB':>8s} eq"]
    for v, by in r["variants"].items():
        for p, row in by.items():
            io = row["io_blocked_s"]
            nv = row["nvme_bytes_read"]
            lines.append(f"{v:14s} {p:8s} {row['ttft_p50_s']:7.3f} {row['ttft_p90_s']:7.3f} {row['ttft_p99_s']:7.3f} "
                         f"{'-' if io is None else f'{io:7.3f}':>7s} {'-' if nv is None else f'{nv / 1e6:8.1f}':>8s} "
                         f"{row['outputs_equal']}")
    lines.append(f"outputs_equal {r['outputs_equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(common.main("python -m ucm.bench.engines.prefetch_bench", __doc__, _add_args, run))
