"""Recall of oracle, quest, moment and mean on the queries of the model's
own continuation (docs/lab/benchmarks.md, "the `moment` selector in the closed
loop at 8K"): the closed loop's two 8K prompts of Python sources, then
teacher-forced on dense greedy's 64 tokens as recorded in
`docs/lab/data/sparse_bench_8k_moment.json`, every 4th step replayed (16 steps
x 30 layers per prompt), 16-token pages, sink 128 and local 256 kept.
Recall is the share of the layer's true attention mass selected (mean /
5th percentile).

Not part of the package: an experiment record, run with the development
install (about 7 minutes of 8K eager prefill per prompt on 2 cores):

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_own_continuation.py
"""
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.mass import token_mass
from ucm.accelerators.sparse.selectors import make_selector
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL, CTX, STEPS, EVERY = 16, 128, 256, 8192, 64, 4
RUN = Path(__file__).resolve().parents[2] / "docs" / "lab" / "data" / "sparse_bench_8k_moment.json"


def main():
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok(find_document("stdlib")[1], return_tensors="pt").input_ids
    dense = json.loads(RUN.read_text())["closed_loop"]["dense_tokens"]
    sels = {n: make_selector(n) for n in ("oracle", "quest", "moment", "mean")}
    for i, cont in enumerate(dense):
        rec = record(d, torch.cat([ids[:, i * CTX:(i + 1) * CTX], torch.tensor([cont])], 1), CTX, STEPS, 128)
        res = {}
        for step in rec["steps"][::EVERY]:
            for layer, (q, n, scale) in enumerate(step):
                k = rec["keys"][layer][:, :n]
                ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=rec["kv_heads"],
                               summaries=units_from_keys(k, PT), keys=k, scale=scale)
                mass = token_mass(q, k, scale)
                for b in (1024, 2048):
                    cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                    for name, sel in sels.items():
                        res.setdefault((name, b), []).append(float(mass[sel.select(ls, cfg).mask()].sum()))
        for b in (1024, 2048):
            print("prompt", i + 1, b, "  ".join(f"{n}: {np.mean(res[(n, b)]):.3f}/{np.percentile(res[(n, b)], 5):.3f}"
                                                for n in sels), flush=True)


if __name__ == "__main__":
    main()
