"""`blend` with each query head's best page by quest's bound kept first
(docs/lab/benchmarks.md, "blend with each head's best quest page"): the 8K
closed loop's setting (two prompts of Python sources, 64 greedy and
teacher-forced tokens, five 4K passkey tasks in filler), one budget. A
test of whether the passkeys `blend` lost come back when every retrieval
head's single strongest page is guaranteed; the variant is registered
here only, not shipped.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_blend_heads.py 1024
"""
import argparse
import sys

import numpy as np

from ucm.accelerators.sparse import selectors
from ucm.accelerators.sparse.selectors import BlendSelector, _summaries, quest_bound


class BlendHeadsSelector(BlendSelector):
    name = "blendheads"

    def score(self, step, candidates):
        rank, mass = super().score(step, candidates)
        s = _summaries(step, self.name)
        best = np.unique(quest_bound(step.query, s.min[candidates], s.max[candidates]).argmax(axis=1))
        rank = rank.copy()
        rank[best] = np.inf  # every query head's best page by quest first, then blend's order
        return rank, mass


def main():
    selectors.SELECTORS["blendheads"] = BlendHeadsSelector
    from ucm.bench.engines.sparse_bench import register

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    register(sub)
    args = ap.parse_args(["sparse", "--document", "stdlib", "--context", "8192", "--steps", "0", "--budgets",
                          sys.argv[1], "--top-p", "", "--selectors", "blendheads", "--samples", "2",
                          "--passkey-lengths", "4096", "--passkey-samples", "5", "--passkey-haystack", "filler",
                          "--no-full-check"])
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
