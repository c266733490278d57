"""What `ucm bench blend` reports for either engine (blend_bench.py for
transformers, blend_vllm.py for vLLM): a method's row of the JSON from its
per-prompt figures, the workload's description, the table and the plot of
KL against TTFT."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, Optional


def workload(prompts: list, args: argparse.Namespace, passage_tokens: int, block_tokens: int) -> dict[str, Any]:
    """The JSON's description of the workload both engines ran."""
    return {"prompts": len(prompts), "k": len(prompts[0].spans), "pool": args.pool or (6 if args.quick else 12),
            "passage_tokens": passage_tokens, "mean_prompt_tokens": statistics.fmean(len(p.ids) for p in prompts),
            "needle_prompts": sum(p.kind == "needle" for p in prompts),
            "two_hop_prompts": sum(p.kind == "two_hop" for p in prompts),
            "answer_tokens": args.answer_tokens, "block_tokens": block_tokens, "seed": args.seed}


def label(m: dict[str, Any]) -> str:
    alone = " (alone)" if m.get("context") == "none" else ""
    if m["method"] == "blend":
        return f"blend {m['ratio'] * 100:.0f}% {m['select']}{alone}"
    if m["method"] == "prefix":
        return f"prefix ({m['source']})"
    if m["method"] == "leading":
        return f"leading {m['leading_tokens']}"
    return m["method"] + alone


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def row(m: dict[str, Any], d: dict[str, list], block_bytes: int, engine: str = "transformers") -> dict[str, Any]:
    """One method's row of the JSON from its per-prompt figures `d`."""
    reads: dict[str, int] = {}
    for r in d["reads"]:
        for t, n in r.items():
            reads[t] = reads.get(t, 0) + n
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"engine": engine, "method": m["method"], "select": m.get("select"), "source": m["source"],
            "ratio": m["ratio"],
            "leading_tokens": m.get("leading_tokens"), "label": label(m),
            "context": m.get("context", "prefix") if m["method"] in ("naive", "blend", "leading") else None,
            "ttft_p50_s": statistics.median(d["ttft"]), "ttft_p90_s": pct(d["ttft"], 0.9),
            "kl": mean(d["kl"]), "greedy_agreement": mean(d["agree"]),
            "needle_accuracy": mean([float(x) for x in d["needle"]]),
            "two_hop_accuracy": mean([float(x) for x in d["two_hop"]]),
            "recompute_share": mean(d["work"]),
            "kv_read_bytes": {t: n * block_bytes // max(1, len(d["reads"])) for t, n in reads.items()}}


def table(r: dict[str, Any]) -> str:
    lines = [f"{r['machine']}; {r['workload']['prompts']} prompts of {r['workload']['k']} passages of "
             f"{r['workload']['passage_tokens']} tokens ({r['source']}), {r['dtype']}",
             f"{'method':<28}{'TTFT p50':>10}{'p90':>8}{'compute':>9}{'KL':>8}{'agree':>7}{'needle':>8}"
             f"{'2-hop':>7}  KV read per request"]
    full = next(x for x in r["rows"] if x["method"] == "full")
    for x in r["rows"]:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        reads = ", ".join(f"{t} {b / (1 << 20):.0f} MiB" for t, b in x["kv_read_bytes"].items() if b)
        lines.append(f"{x['label']:<28}{x['ttft_p50_s'] * 1000:>8.0f}ms{x['ttft_p90_s'] * 1000:>6.0f}ms"
                     f"{x['recompute_share']:>9.2f}{x['kl']:>8.3f}{x['greedy_agreement']:>7.2f}"
                     f"{fmt(x['needle_accuracy']):>8}{fmt(x['two_hop_accuracy']):>7}  {reads or '-'}")
    lines.append("TTFT against the full prefill's: " + ", ".join(
        f"{x['label']} {x['ttft_p50_s'] / full['ttft_p50_s']:.2f}x" for x in r["rows"] if x is not full))
    lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, result: dict[str, Any]) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the `bench` extra): no plot"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for x in rows:
        ax.scatter(x["ttft_p50_s"], x["kl"], s=40, color="#444" if x["method"] in ("full", "prefix") else "#c33")
        below = x["method"] == "full"  # the prefix rows sit at its KL (0), near its TTFT
        ax.annotate(x["label"], (x["ttft_p50_s"], x["kl"]), textcoords="offset points",
                    xytext=(5, -11 if below else 4), fontsize=8)
    ax.set_xlabel("TTFT p50 (s)")
    ax.set_ylabel(f"KL to the full prefill (mean over {result['workload']['answer_tokens']} answer tokens)")
    w = result["workload"]
    ax.set_title(f"ucm bench blend: {w['prompts']} prompts, {w['k']} passages of {w['passage_tokens']} tokens, "
                 f"SmolLM2 {result['dtype']}, {result['engine']}", fontsize=9)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
