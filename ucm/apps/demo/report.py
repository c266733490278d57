"""What the demo prints and draws: the machine in one line (from /proc),
a table of TTFT per request class and of prompt tokens by source for each
run, and a PNG plot. Pure functions of the runs' rows; no engine."""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from ucm.apps.demo.workload import CLASSES

SOURCES = (("engine_tokens", "vLLM prefix cache"), ("ucm_dram_tokens", "ucm DRAM"),
           ("ucm_nvme_tokens", "ucm NVMe"), ("computed_tokens", "computed (prefill)"))
CLASS_COLORS = {CLASSES[0]: "#d62728", CLASSES[1]: "#ff9896", CLASSES[2]: "#1f77b4", CLASSES[3]: "#aec7e8"}
SOURCE_COLORS = ("#7f7f7f", "#2ca02c", "#98df8a", "#c7c7c7")


def machine_line(proc: str = "/proc") -> str:
    """CPU model, cores usable, RAM and GPUs, read from /proc."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path(proc, "cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = " ".join(val.split())
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    mem_gib = None
    try:
        for line in Path(proc, "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    gpus_dir = Path(proc, "driver", "nvidia", "gpus")
    gpus = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    gpu = f"{gpus} NVIDIA GPU(s)" if gpus else "no GPU"
    mem = f"{mem_gib:.1f} GiB RAM" if mem_gib is not None else "RAM unknown"
    return f"{model}, {cores} cores ({isa}), {mem}, {gpu}"


def _pct(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1])."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(runs: Sequence[dict[str, Any]], classes: dict[int, str]) -> dict[str, Any]:
    """Per run: TTFT p50/p90 per class and overall (seconds), prompt tokens
    by source, and outputs equal to the reference (run 0)."""
    ref = {r["index"]: r["tokens"] for r in runs[0]["rows"]}
    out = []
    for run in runs:
        rows = run["rows"]
        for r in rows:
            r["computed_tokens"] = r["prompt_tokens"] - r["engine_tokens"] - r["ucm_tokens"]
        ttft: dict[str, dict[str, float]] = {}
        for cls in (*CLASSES, "all"):
            xs = [r["ttft_s"] for r in rows if cls == "all" or classes[r["index"]] == cls]
            if xs:
                ttft[cls] = {"n": len(xs), "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9), "mean": statistics.fmean(xs)}
        tokens = {k: sum(r[k] for r in rows) for k, _ in SOURCES}
        equal = [r["index"] for r in rows if r["tokens"] == ref.get(r["index"])]
        out.append({"name": run["name"], "ttft_s": ttft, "tokens": tokens, "equal": len(equal), "n": len(rows),
                    "unequal": sorted(set(ref) - set(equal)), "total_ttft_s": sum(r["ttft_s"] for r in rows)})
    return {"runs": out}


def table(summary: dict[str, Any]) -> str:
    """The printed table: TTFT p50 / p90 (ms) per class, then tokens by source."""
    runs = summary["runs"]
    w = 22
    lines = [f"{'TTFT ms, p50 / p90':<20}{'n':>4}  " + "".join(f"{r['name']:>{w}}" for r in runs)]
    for cls in (*CLASSES, "all"):
        cells = []
        n = None
        for r in runs:
            t = r["ttft_s"].get(cls)
            n = t["n"] if t else n
            cells.append(f"{t['p50'] * 1000:.0f} / {t['p90'] * 1000:.0f}" if t else "-")
        if n is not None:
            lines.append(f"{cls:<20}{n:>4}  " + "".join(f"{c:>{w}}" for c in cells))
    base = runs[0]["total_ttft_s"]
    lines.append(f"{'sum of TTFTs (s)':<26}" + "".join(
        f"{r['total_ttft_s']:>{w - 8}.1f}" + (f" ({base / r['total_ttft_s']:.2f}x)" if i else " " * 8)
        for i, r in enumerate(runs)))
    lines.append("")
    lines.append(f"{'prompt tokens from':<26}" + "".join(f"{r['name']:>{w}}" for r in runs))
    for key, label in SOURCES:
        lines.append(f"{label:<26}" + "".join(f"{r['tokens'][key]:>{w},}" for r in runs))
    equal = ["(reference)"] + [f"{r['equal']}/{r['n']}" for r in runs[1:]]
    lines.append(f"{'outputs equal to run 1':<26}" + "".join(f"{e:>{w}}" for e in equal))
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], classes: dict[int, str], summary: dict[str, Any], path: Path,
         title: str) -> Optional[str]:
    """TTFT of every request in arrival order, one panel per run, bars
    coloured by class; beside them, prompt tokens by source per run. Returns
    a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return "matplotlib is not installed (the `bench` extra): no plot"
    n = len(runs)
    fig = plt.figure(figsize=(14, 2.3 * n + 1.6))
    grid = fig.add_gridspec(n, 2, width_ratios=(3.2, 1), hspace=0.35, wspace=0.18)
    top = max(r["ttft_s"] for run in runs for r in run["rows"]) * 1000 * 1.08
    ax0 = None
    for i, run in enumerate(runs):
        ax = fig.add_subplot(grid[i, 0], sharex=ax0)
        ax0 = ax0 or ax
        rows = run["rows"]
        xs = [r["index"] + 1 for r in rows]
        ax.bar(xs, [r["ttft_s"] * 1000 for r in rows], color=[CLASS_COLORS[classes[r["index"]]] for r in rows],
               width=0.8)
        s = summary["runs"][i]
        ax.set_ylim(0, top)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{run['name']}: sum of TTFTs {s['total_ttft_s']:.1f} s, "
                     f"p50 {s['ttft_s']['all']['p50'] * 1000:.0f} ms", loc="left", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if i == n - 1:
            ax.set_xlabel("request, in arrival order")
    ax0.legend(handles=[Patch(color=CLASS_COLORS[c], label=c) for c in CLASSES], loc="upper right", fontsize=8,
               ncol=2)
    axb = fig.add_subplot(grid[:, 1])
    names = [s["name"].replace(" + ", "\n+ ") for s in summary["runs"]]
    bottom = [0.0] * n
    for (key, label), color in zip(SOURCES, SOURCE_COLORS):
        vals = [s["tokens"][key] / 1000 for s in summary["runs"]]
        axb.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axb.set_ylabel("prompt tokens (thousands)")
    axb.set_title("where prompt tokens came from", fontsize=10)
    axb.legend(fontsize=8, loc="lower right")
    axb.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None
