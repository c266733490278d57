"""Top-p over the whole attention (docs/lab/benchmarks.md, "the `moment`
selector, offline at 8K"): instead of p of the candidates' estimated mass,
each query head's softmax over the kept tokens' exact logits (sink, local:
resident) and the candidates' estimated log masses (`log 16 + s x score`
of moment, quest or mean), averaged over heads; the fewest candidates
whose estimated share, added to the kept tokens', reaches p. Recall (share
of the layer's true attention mass selected, mean / 5th percentile) and
attended share of dense at each p.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_topp_whole.py stdlib 8192 8 0.6,0.7,0.8,0.9,0.95
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from ucm.accelerators.sparse.mass import grouped, token_mass
from ucm.accelerators.sparse.selectors import mean_score, moment_score, quest_bound
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.accelerators.sparse.units import candidate_units
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256


def scores(name, q, su, cands, scale):
    if name == "moment":
        return moment_score(q, su.mean[cands], su.min[cands], su.max[cands], PT, scale, 1.5)
    if name == "quest":
        return quest_bound(q, su.min[cands], su.max[cands])
    return mean_score(q, su.mean[cands])


def main():
    kind, ctx, steps, ps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [float(x) for x in sys.argv[4].split(",")]
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    res = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k = rec["keys"][layer][:, :n]
            su = units_from_keys(k, PT)
            cands = candidate_units(n, PT, su.units, SINK, LOCAL)
            mass = token_mass(q, k, scale)
            kept = np.ones(n, bool)
            for c in cands:
                kept[c * PT:(c + 1) * PT] = False
            lg = np.einsum("hgd,htd->hgt", grouped(q, rec["kv_heads"]), k[:, kept]).reshape(q.shape[0], -1)
            lg = lg.astype(np.float64) * scale
            m = lg.max(1)
            kept_lse = m + np.log(np.exp(lg - m[:, None]).sum(1))
            unit_true = mass[:su.units * PT].reshape(-1, PT).sum(1)[cands]
            for name in ("moment", "quest", "mean"):
                cl = scores(name, q, su, cands, scale).astype(np.float64) * scale + np.log(PT)
                both = np.concatenate([cl, kept_lse[:, None]], 1)
                e = np.exp(both - both.max(1, keepdims=True))
                e /= e.sum(1, keepdims=True)
                share, kept_share = e[:, :-1].mean(0), e[:, -1].mean()
                order = np.argsort(-share, kind="stable")
                cum = kept_share + np.cumsum(share[order])
                for p in ps:
                    take = 0 if kept_share >= p else min(len(order), int(np.searchsorted(cum, p)) + 1)
                    r = res.setdefault((name, p), ([], []))
                    r[0].append(mass[kept].sum() + unit_true[order[:take]].sum())
                    r[1].append((kept.sum() + take * PT) / n)
    for p in ps:
        print(p, "  ".join(f"{nm}: {np.mean(res[(nm, p)][0]):.3f}/{np.percentile(res[(nm, p)][0], 5):.3f} "
                          f"attended {100 * np.mean(res[(nm, p)][1]):.1f} %" for nm in ("moment", "quest", "mean")))


if __name__ == "__main__":
    main()
