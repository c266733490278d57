"""Attention over the selection plus an estimate of the pages left out
(docs/lab/benchmarks.md, "the pages left out, estimated"): at 8K this model's
attention is flat (the oracle's 1,024 tokens hold 0.84 of the mass), so a
selection renormalised over its own tokens drops the rest of the mass and
shifts the output toward what it kept. Here each candidate page not
selected joins the softmax as one virtual token: key the page's mean key,
log weight `log 16` (16 tokens) plus, for `tail=moment`, moment's spread
term (`s^2/2 sum_d q_d^2 sigma_d^2`, sigma from the page's key range),
value the page's mean value (RetroInfer-style estimation of the
unselected clusters). Relative L2 error of each layer's attention output
against dense, per selector and budget, mean (95th percentile), over the
recorded teacher-forced steps of one document.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_tail_estimate.py stdlib 8192 4 512,1024,2048
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.mass import grouped
from ucm.accelerators.sparse.selectors import expected_range, make_selector
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import head_probs, record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256
TAILS = ("none", "mean", "moment", "true")


def attend(q, k, v, mask, scale, virt_k=None, virt_v=None, virt_bias=None):
    """Each query head's output `[q_heads, dim]` over the tokens of `mask`
    and, when given, virtual tokens (key, value, added log weight per head)."""
    h = k.shape[0]
    qg = grouped(q, h).astype(np.float64)  # [h, g, d]
    lg = np.einsum("hgd,htd->hgt", qg, k[:, mask].astype(np.float64)) * scale
    vals = v[:, mask].astype(np.float64)
    if virt_k is not None:
        vl = np.einsum("hgd,hud->hgu", qg, virt_k.astype(np.float64)) * scale + virt_bias
        lg = np.concatenate([lg, vl], axis=2)
        vals = np.concatenate([vals, virt_v.astype(np.float64)], axis=1)
    lg -= lg.max(axis=2, keepdims=True)
    w = np.exp(lg)
    w /= w.sum(axis=2, keepdims=True)
    return np.einsum("hgt,htd->hgd", w, vals).reshape(q.shape[0], -1)


def main():
    kind, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    budgets = [int(x) for x in sys.argv[4].split(",")]
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else ["oracle", "quest", "moment", "mean"]
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    sels = {n: make_selector(n) for n in names}
    res = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k, v = rec["keys"][layer][:, :n], rec["values"][layer][:, :n]
            h = k.shape[0]
            su = units_from_keys(k, PT)
            full = su.units
            vmean = v[:, :full * PT].reshape(h, full, PT, -1).mean(axis=2)  # [h, units, d]
            kmean = su.mean.transpose(1, 0, 2)  # [h, units, d]
            sigma = (su.max - su.min).transpose(1, 0, 2) / expected_range(PT)
            probs = head_probs(q, k, scale)
            group = probs.shape[0] // h
            dense = np.einsum("hgt,htd->hgd", probs.reshape(h, group, -1), v.astype(np.float64)).reshape(
                q.shape[0], -1)
            norm = np.linalg.norm(dense)
            qg = grouped(q, h).astype(np.float64)
            var_term = 0.5 * scale * scale * np.einsum("hgd,hud->hgu", qg * qg, sigma.astype(np.float64) ** 2)
            lg = np.einsum("hgd,htd->hgt", qg, k[:, :full * PT].astype(np.float64)) * scale
            lg = lg.reshape(h, group, full, PT)
            mx = lg.max(axis=3)
            true_lse = mx + np.log(np.exp(lg - mx[..., None]).sum(axis=3))
            mean_logit = np.einsum("hgd,hud->hgu", qg, kmean.astype(np.float64)) * scale
            ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=h, summaries=su, keys=k, scale=scale)
            for b in budgets:
                cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                for name, sel_ in sels.items():
                    sel = sel_.select(ls, cfg)
                    m = sel.mask()
                    left = np.array(sorted(set(range(full)) - {u for u in range(full)
                                                               if m[u * PT:(u + 1) * PT].all()}), dtype=np.int64)
                    for tail in TAILS:
                        if tail == "none" or left.size == 0:
                            out = attend(q, k, v, m, scale)
                        else:
                            bias = np.full((h, group, left.size), np.log(PT))
                            if tail == "moment":
                                bias = bias + var_term[:, :, left]
                            elif tail == "true":  # the page's true log mass: the bound of this estimate
                                bias = true_lse[:, :, left] - mean_logit[:, :, left]
                            out = attend(q, k, v, m, scale, kmean[:, left], vmean[:, left], bias)
                        res.setdefault((name, b, tail), []).append(float(np.linalg.norm(out - dense) / norm))
    print(f"{kind}, {ctx} tokens, {steps} steps x {len(rec['steps'][0])} layers; output error mean (p95)")
    print("| selector | budget | renormalised | + pages left out (mean key) | + pages left out (moment) "
          "| + pages left out (true mass) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for b in budgets:
            cells = [res[(name, b, t)] for t in TAILS]
            print(f"| {name} | {b} | " + " | ".join(f"{np.mean(c):.3f} ({np.percentile(c, 95):.3f})" for c in cells)
                  + " |")


if __name__ == "__main__":
    main()
