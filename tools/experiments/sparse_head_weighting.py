"""The quest variants of docs/lab/benchmarks.md ("2026-12-03 20:20-20:30: the
issue's 8K context"): recall (share of the layer's true attention mass
selected, mean / 5th percentile) of the shipped selectors and of quest
with each head weighted by its estimated share of mass outside the kept
tokens (`questW<T>`: exact logits of sink and local, bounds for the
candidate pages, T tokens per page), the same for the mean-key score, and
the mean of the quest bound and the mean-key score (`mixW<T>`).

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_head_weighting.py stdlib 8192 4 512,1024,2048

(records queries and keys as `ucm bench sparse` does, then replays).
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig, Selector, UnitSummaries
from ucm.accelerators.sparse.mass import grouped, token_mass
from ucm.accelerators.sparse.selectors import make_selector, mean_score, quest_bound
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256


def summaries(k, n_units):
    kk = k[:, :n_units * PT].reshape(k.shape[0], n_units, PT, -1)
    return UnitSummaries(PT, n_units, kk.min(2).transpose(1, 0, 2).copy(), kk.max(2).transpose(1, 0, 2).copy(),
                         kk.mean(2).transpose(1, 0, 2).copy())


class Variant(Selector):
    def __init__(self, fn):
        self.fn = fn

    def score(self, step, cands):
        r = self.fn(step, cands)
        return r, r


def kept_logsumexp(step, cands):
    """Per query head, log sum exp of the logits over the tokens always kept."""
    mask = np.ones(step.n_tokens, bool)
    for c in cands:
        mask[c * PT:(c + 1) * PT] = False
    qg = grouped(step.query, step.kv_heads)
    lg = np.einsum("hgd,htd->hgt", qg, step.keys[:, mask]).reshape(step.query.shape[0], -1) * step.softmax_scale
    m = lg.max(1, keepdims=True)
    return m[:, 0] + np.log(np.exp(lg - m).sum(1))


def weighted(score_fn, tokens):
    def fn(step, cands):
        b = score_fn(step, step.summaries, cands) * step.softmax_scale + np.log(tokens)
        both = np.concatenate([b, kept_logsumexp(step, cands)[:, None]], 1)
        e = np.exp(both - both.max(1, keepdims=True))
        return (e / e.sum(1, keepdims=True))[:, :-1].mean(0)
    return fn


def main():
    kind, ctx, steps, budgets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    qb = lambda st, s, c: quest_bound(st.query, s.min[c], s.max[c])  # noqa: E731
    mb = lambda st, s, c: mean_score(st.query, s.mean[c])  # noqa: E731
    mix = lambda st, s, c: 0.5 * qb(st, s, c) + 0.5 * mb(st, s, c)  # noqa: E731
    variants = {n: make_selector(n) for n in ("oracle", "quest", "mean")}
    for t in (1, 4, 16):
        variants[f"questW{t}"] = Variant(weighted(qb, t))
    variants["meanW16"] = Variant(weighted(mb, 16))
    variants["mixW16"] = Variant(weighted(mix, 16))
    variants["mixW4"] = Variant(weighted(mix, 4))
    res = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k = rec["keys"][layer][:, :n]
            ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=rec["kv_heads"],
                           summaries=summaries(k, ctx // PT), keys=k, scale=scale)
            mass = token_mass(q, k, scale)
            for b in (int(x) for x in budgets.split(",")):
                cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                for name, sel in variants.items():
                    res.setdefault((name, b), []).append(float(mass[sel.select(ls, cfg).mask()].sum()))
    for b in (int(x) for x in budgets.split(",")):
        print(b, " ".join(f"{n}:{np.mean(res[(n, b)]):.3f}/{np.percentile(res[(n, b)], 5):.3f}" for n in variants))


if __name__ == "__main__":
    main()
