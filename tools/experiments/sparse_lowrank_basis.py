"""How `lowrank` came about (docs/lab/benchmarks.md, "the `lowrank` selector"):
Loki-style selection, keys projected on a rank-r basis per (layer, KV
head), each token's logit approximated from q P . k P, pages ranked by
their approximate mass, on one document's recorded queries and keys
(teacher-forced steps). `lr{r}`: one basis for all blocks, fitted on a
calibration document's keys (2,048 tokens of `calib`; or on the
document's own context when none is given); `blk{r}`: each 128-token
block's own basis (`c`: its keys centred first). Pages of 16 tokens,
sink 128 + local 256.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/sparse_lowrank_basis.py stdlib 8192 2 512,1024,2048 2,4 essays
"""
import sys, time
import numpy as np
from transformers import AutoTokenizer
from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig, Selector
from ucm.accelerators.sparse.mass import token_mass
from ucm.accelerators.sparse.selectors import make_selector
from ucm.accelerators.sparse.summaries import units_from_keys
from ucm.apps.model import prepare
from ucm.bench.engines.sparse_bench import record
from ucm.bench.engines.sparse_tasks import find_document

PT, SINK, LOCAL = 16, 128, 256

def basis(keys, r, centered=False):
    # keys [H, n, D] -> [H, D, r]
    out = []
    for h in range(keys.shape[0]):
        k = keys[h].astype(np.float64)
        if centered:
            k = k - k.mean(0)
        _, _, vt = np.linalg.svd(k, full_matrices=False)
        out.append(vt[:r].T.astype(np.float32))
    return np.stack(out)

class LowRank(Selector):
    name = "lowrank"
    needs_keys = True
    def __init__(self, P):
        self.P = P  # per layer [H, D, r]
        self.layer = 0
    def score(self, step, candidates):
        P = self.P[self.layer]
        kp = np.einsum("htd,hdr->htr", step.keys, P)
        ka = np.einsum("htr,hdr->htd", kp, P)
        mass = token_mass(step.query, ka, step.softmax_scale)
        u = step.unit_tokens
        per_unit = mass[:step.scored_units * u].reshape(-1, u).sum(axis=1)[candidates]
        return per_unit, per_unit

class BlockLR(Selector):
    """each 128-token block's own rank-r basis (its keys' SVD per kv head)"""
    name = "blocklr"
    needs_keys = True
    def __init__(self, r, bt, centered=False):
        self.r, self.bt, self.centered = r, bt, centered
    def score(self, step, candidates):
        k = step.keys
        H, n, D = k.shape
        nb = n // self.bt
        ka = k.copy()
        kb = k[:, :nb * self.bt].reshape(H, nb, self.bt, D).astype(np.float64)
        mu = kb.mean(2, keepdims=True) if self.centered else 0 * kb[:, :, :1]
        _, _, vt = np.linalg.svd(kb - mu, full_matrices=False)  # H nb D D
        P = vt[:, :, :self.r].transpose(0, 1, 3, 2)  # H nb D r
        proj = np.einsum("hbtd,hbdr->hbtr", kb - mu, P)
        ka[:, :nb * self.bt] = (np.einsum("hbtr,hbdr->hbtd", proj, P) + mu).reshape(H, nb * self.bt, D)
        mass = token_mass(step.query, ka.astype(np.float32), step.softmax_scale)
        u = step.unit_tokens
        per_unit = mass[:step.scored_units * u].reshape(-1, u).sum(axis=1)[candidates]
        return per_unit, per_unit

def main():
    kind, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    budgets = [int(x) for x in sys.argv[4].split(",")]
    ranks = [int(x) for x in sys.argv[5].split(",")]
    calib = sys.argv[6] if len(sys.argv) > 6 else None
    d = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(d)
    t0 = time.time()
    rec = record(d, tok(find_document(kind)[1], return_tensors="pt").input_ids, ctx, steps, 128)
    print("record", time.time() - t0, flush=True)
    if calib:
        crec = record(d, tok(find_document(calib)[1], return_tensors="pt").input_ids, 2048, 1, 128)
        ckeys = crec["keys"]
    else:
        ckeys = [k[:, :ctx] for k in rec["keys"]]
    sels = {"oracle": make_selector("oracle"), "quest": make_selector("quest"), "blend": make_selector("blend")}
    for r in ranks:
        sels[f"lr{r}"] = LowRank([basis(k, r) for k in ckeys])
        sels[f"blk{r}"] = BlockLR(r, 128)
        sels[f"blk{r}c"] = BlockLR(r, 128, centered=True)
    res = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k = rec["keys"][layer][:, :n]
            mass = token_mass(q, k, scale)
            ls = LayerStep(query=q, n_tokens=n, unit_tokens=PT, kv_heads=k.shape[0], summaries=units_from_keys(k, PT),
                           keys=k, scale=scale)
            for b in budgets:
                cfg = SelectionConfig(Budget.tokens(b), SINK, LOCAL)
                for name, sel in sels.items():
                    if isinstance(sel, LowRank):
                        sel.layer = layer
                    res.setdefault((name, b, layer), []).append(float(mass[sel.select(ls, cfg).mask()].sum()))
    layers = len(rec["steps"][0])
    print(f"{kind}, {ctx} tokens, {steps} steps, calib {calib}: mean recall")
    print("| budget | " + " | ".join(sels) + " |")
    for b in budgets:
        row = [np.mean([x for layer in range(layers) for x in res[(name, b, layer)]]) for name in sels]
        print(f"| {b} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    b = budgets[len(budgets) // 2]
    print("per layer at", b)
    for layer in range(layers):
        print(layer, " ".join(f"{np.mean(res[(name, b, layer)]):.3f}" for name in sels))

if __name__ == "__main__":
    main()
