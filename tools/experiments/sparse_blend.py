"""How `blend` was chosen (docs/lab/benchmarks.md, "the `blend` selector"):
on one document's recorded queries and keys (teacher-forced steps), the
attention-mass recall of quest and moment per layer, and of their blend
`w * quest_bound + (1 - w) * moment_score` ranked by the query heads'
mean score (ucm/accelerators/sparse/selectors.py, `BlendSelector`) for
w in 0, 0.25, 0.5, 0.75, 1; w = 0 and 1 are moment's and quest's own
scores with the heads combined as blend combines them (quest and moment
themselves average the heads' estimated masses). Pages of 16 tokens,
sink 128 + local 256, one selection per layer shared by its heads.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_blend.py stdlib 8192 4 512,1024,2048
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.mass import token_mass
from ucm.accelerators.sparse.selectors import make_selector
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256
WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main():
    kind, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    budgets = [int(x) for x in sys.argv[4].split(",")]
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    sels = {"oracle": make_selector("oracle"), "quest": make_selector("quest"), "moment": make_selector("moment")}
    sels.update({f"blend w={w}": make_selector("blend", weight=w) for w in WEIGHTS})
    res: dict = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k = rec["keys"][layer][:, :n]
            mass = token_mass(q, k, scale)
            ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=k.shape[0], summaries=units_from_keys(k, PT),
                           keys=k, scale=scale)
            for b in budgets:
                cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                for name, sel in sels.items():
                    res.setdefault((name, b, layer), []).append(float(mass[sel.select(ls, cfg).mask()].sum()))
    layers = len(rec["steps"][0])
    print(f"{kind}, {ctx} tokens, {steps} steps x {layers} layers: mean recall")
    print("| budget | " + " | ".join(sels) + " |")
    print("|---" * (len(sels) + 1) + "|")
    for b in budgets:
        row = [np.mean([x for layer in range(layers) for x in res[(name, b, layer)]]) for name in sels]
        print(f"| {b} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    b = budgets[len(budgets) // 2]
    print(f"\nper layer at {b} tokens: oracle / quest / moment / blend w=0.5")
    for layer in range(layers):
        print(f"{layer:>3} " + " ".join(f"{np.mean(res[(name, b, layer)]):.3f}"
                                        for name in ("oracle", "quest", "moment", "blend w=0.5")))


if __name__ == "__main__":
    main()
