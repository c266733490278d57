"""PNG plots of `ucm bench sparse`'s quality against bytes, one line per
selector: attention-mass recall (offline replay, 16-token pages) and greedy
agreement (closed loop) against the bytes attended per decoded token as a
share of dense decode's (closed loop). Fixed token budgets are joined by a
line; top-p budgets are open markers. matplotlib (the test extras) with
the Agg backend; runs in the caller's thread."""
from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"oracle": "black", "lowrank": "tab:olive", "hybrid": "tab:brown", "quest": "tab:blue", "blend": "tab:cyan",
          "moment": "tab:purple", "mean": "tab:orange", "sinklocal": "tab:green", "random": "tab:red"}


def write_plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """Writes `sparse_recall_vs_bytes.png` and `sparse_greedy_vs_bytes.png`
    under `out_dir`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recall = {(r["selector"], r["budget"]): r["recall_mean"] for r in result["offline"]["rows"]
              if r["units"] == "pages"}
    first = min((r.get("reselect_every", 1) for r in result["closed_loop"]["rows"]), default=1)  # a curve each
    rows = [r for r in result["closed_loop"]["rows"] if not r["budget"].startswith("ratio")
            and r.get("reselect_every", 1) == first]
    title = (f"SmolLM2-135M, {result['context']}-token context, sink {result['sink']} + local {result['local']}, "
             f"{result['page_tokens']}-token pages")
    paths = []
    for name, ylabel, value in (
            ("sparse_recall_vs_bytes.png", "attention-mass recall (mean, offline replay)",
             lambda r: recall.get((r["selector"], r["budget"]))),
            ("sparse_greedy_vs_bytes.png", f"greedy agreement over {result['closed_loop']['new_tokens']} tokens",
             lambda r: r["greedy_agreement"])):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for sel in dict.fromkeys(r["selector"] for r in rows):
            fixed = sorted(((100 * r["bytes_share"], value(r)) for r in rows
                            if r["selector"] == sel and r["budget"].startswith("tokens") and value(r) is not None))
            topp = [(100 * r["bytes_share"], value(r), r["budget"].split("=")[1]) for r in rows
                    if r["selector"] == sel and r["budget"].startswith("top_p") and value(r) is not None]
            c = COLORS.get(sel)
            if fixed:
                ax.plot([x for x, _ in fixed], [y for _, y in fixed], "o-", color=c, label=f"{sel} (tokens)")
            if topp:
                ax.scatter([x for x, _, _ in topp], [y for _, y, _ in topp], facecolors="none", edgecolors=c,
                           marker="s", label=f"{sel} (top-p)")
                for x, y, p in topp:
                    ax.annotate(p, (x, y), fontsize=7, xytext=(3, -9), textcoords="offset points", color=c)
        ax.set_xlabel("bytes attended per decoded token, % of dense")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(str(path))
    return paths
