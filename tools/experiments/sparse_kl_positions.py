"""Where the closed loop's KL comes from (docs/lab/benchmarks.md, "KL by
position"): the 8K closed loop's two prompts, teacher-forced on dense
greedy's 64 tokens through `SparseDecoder` (as `ucm bench sparse` does),
per selector at one budget; per decoded position KL(dense || sparse) and
dense's top-1 margin (its two largest probabilities' difference). Prints
each selector's mean KL, the share of it from the 5 largest positions,
the mean without them, and the mean KL where dense is sure (margin > 0.5)
and where it is not.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_kl_positions.py 1024 quest,mean,blend
"""
import sys

import numpy as np
import torch
from transformers import AutoTokenizer

from ucm.accelerators.sparse.base import Budget
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import load_model
from ucm.bench.engines.sparse_closed_loop import _generate
from ucm.bench.engines.sparse_tasks import find_document
from ucm.cache.unified import UnifiedCache
from ucm.connectors.transformers import TransformersConnector
from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder

CONTEXT, NEW, BT = 8192, 64, 128


def main():
    budget, names = int(sys.argv[1]), sys.argv[2].split(",")
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok(find_document("stdlib")[1], return_tensors="pt").input_ids
    prompts = [ids[:, i * CONTEXT:(i + 1) * CONTEXT] for i in range(2)]
    model = load_model(d, "eager")
    cache = UnifiedCache({"block_tokens": BT, "tiers": [{"adapter": "dram", "capacity": "1536MiB",
                                                         "options": {"prefault": False}}],
                          "policy": {"name": "lru"}})
    conn = TransformersConnector(model, cache, block_tokens=BT)
    try:
        with torch.no_grad():
            dense = [_generate(conn.generate, p, NEW + 1) for p in prompts]
            conn.wait_stores(120.0)
            ref = [torch.stack([torch.log_softmax(x.double(), -1) for x in lg[1:]]) for _, lg in dense]
            margin = []
            for r in ref:
                top2 = r.exp().topk(2, dim=-1).values
                margin.append((top2[:, 0] - top2[:, 1]).numpy())
            margin = np.concatenate(margin)
            print(f"budget {budget}; {len(margin)} positions, dense margin > 0.5 at {(margin > 0.5).sum()}")
            for name in names:
                dec = SparseDecoder(conn, SparseDecodeConfig(selector=name, budget=Budget.tokens(budget)))
                kls = []
                for p, (toks, _), r in zip(prompts, dense, ref):
                    _, lg = _generate(dec.generate, p, NEW + 1, force=toks)
                    q = torch.stack([torch.log_softmax(x.double(), -1) for x in lg[1:]])
                    kls.append((r.exp() * (r - q)).sum(-1).numpy())
                kl = np.concatenate(kls)
                top = np.argsort(-kl)[:5]
                rest = np.delete(kl, top)
                print(f"{name:<8} KL {kl.mean():.5f}; top 5 positions {sorted(top.tolist())} hold "
                      f"{kl[top].sum() / kl.sum():.0%}; without them {rest.mean():.5f}; "
                      f"sure (margin > 0.5) {kl[margin > 0.5].mean():.5f}, unsure {kl[margin <= 0.5].mean():.5f}; "
                      f"median {np.median(kl):.5f}")
    finally:
        conn.close()
        cache.close()


if __name__ == "__main__":
    main()
