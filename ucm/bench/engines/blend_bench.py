"""`ucm bench blend`: retrieved passages reused wherever they sit in the
prompt (ucm/connectors/transformers/blend.py) against the full prefill and
prefix caching, in transformers (or vLLM, `--engine vllm`) on this machine.

The workload (blend_tasks.py, seeded): prompts of a system prompt + k
passages drawn from a pool and ordered at random + a question whose answer
(a five-digit pass key) sits in one passage (`needle`) or needs two
(`two_hop`). Every passage's entry is in ucm before the measured requests
(one unmeasured blend of every prompt computes and stores them), as in a RAG
service whose corpus was seen before.

Methods, each prompt in turn through every one:
- `full`: plain `generate`, the exact reference;
- `prefix` (`source` `engine`): transformers' own prefix reuse of the system
  prompt (a DynamicCache of it, copied); `prefix` (`source` `ucm`): ucm's
  prefix path (`connector.generate` without chunks: the system prompt, and
  more where an earlier prompt began with the same passage);
- `naive`: blend at ratio 0, the passages' KV concatenated;
- `blend` at each `--ratios`, `select: question` (the tokens the question
  attends to most in the last half of the layers);
- `blend` at the ratio nearest 15 % with `select: deviation` (CacheBlend's
  selection, `check_layers` 1);
- `leading`: each passage's first `--leading-tokens` recomputed (EPIC's);
- `naive` and `blend` (`question`) at the ratio nearest 15 % with
  `context: none`: the passages' entries computed alone at position 0
  (CacheBlend's and EPIC's chunks) rather than after the system prompt
  (ucm's default), labelled "(alone)".

Per method: TTFT p50/p90 (request to first token, loads included: the time
`generate` first asks for a token's logits; each request starts once the
stores before it and the tiers' write-backs are done, so no row is timed
while the one before it still writes), `recompute_share` (layer-token
work of the prefill over the full prefill's: the blended part's checked and
recomputed tokens plus the question, against every token in every layer),
KV bytes read per tier, and quality against the full prefill over the
first `--answer-tokens` tokens of the full prefill's greedy answer,
teacher-forced: `kl` (mean KL of the next-token distributions, full ||
method), `greedy_agreement` (positions whose argmax is the full's answer
token; the answer is generated with the end of text held off for its
length, so the full row reads below 1 where its own argmax was the end);
`needle_accuracy` and `two_hop_accuracy` (the key in the method's own
greedy answer). The JSON: `rows`, one per engine and method with `engine`,
`method`, `select`, `source`, `ratio`, `context`, `ttft_p50_s`, `ttft_p90_s`, `kl`,
`greedy_agreement`, `needle_accuracy`, `two_hop_accuracy`,
`recompute_share`, `kv_read_bytes`; the workload; the machine. A plot of KL
against TTFT p50.

`--engine vllm` runs the same workload on vLLM for CPU through
UCMConnector (blend_vllm.py), with the rows that path has: full, vLLM's
own prefix cache, naive, blend at each ratio, leading.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ucm.bench import common
from ucm.bench.engines.blend_report import label, plot, row, table, workload

BLOCK_TOKENS = 64


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "blend", help="passages reused anywhere in the prompt (CacheBlend-style) against the "
                                        "full prefill and prefix caching, in transformers or vLLM",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_json_flag(p, "print one JSON object (every row, the workload)")
    p.add_argument("--engine", default="transformers", choices=("transformers", "vllm"),
                   help="transformers (default), or vLLM for CPU (blend_vllm.py)")
    p.add_argument("--quick", action="store_true",
                   help="4 prompts of 4 passages of 128 tokens (256 on vLLM), two ratios")
    p.add_argument("--prompts", type=int, default=None, help="prompts (default 20)")
    p.add_argument("--k", type=int, default=None, help="passages per prompt (default 6)")
    p.add_argument("--pool", type=int, default=None, help="passages in the pool (default 12)")
    p.add_argument("--passage-tokens", type=int, default=None, help="tokens per passage (default 512)")
    p.add_argument("--ratios", default=None, help="blend ratios in percent (default 5,10,15,20,30)")
    p.add_argument("--leading-tokens", type=int, default=16, help="tokens per passage under `leading` (16)")
    p.add_argument("--answer-tokens", type=int, default=32, help="answer tokens compared (default 32)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model dtype")
    p.add_argument("--document", default="auto", choices=("auto", "essays", "stdlib"), help="passages' text")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--plot", default="out/blend_quality.png", help="PNG written here (default out/blend_quality.png)")


def run(args: argparse.Namespace) -> int:
    try:
        ratios = [float(x) / 100 for x in (args.ratios or ("10,30" if args.quick else "5,10,15,20,30")).split(",")]
    except ValueError:
        print(f"ucm bench blend: --ratios {args.ratios!r}: comma-separated percents", file=sys.stderr)
        return 2
    if any(not 0 <= r <= 1 for r in ratios):
        print("ucm bench blend: --ratios: each between 0 and 100", file=sys.stderr)
        return 2
    log = common.progress_log(args.json)
    if args.engine == "vllm":
        from ucm.bench.engines import blend_vllm

        result = blend_vllm.measure(args, ratios, log)
        result["plot"] = plot(result["rows"], Path(args.plot).resolve(), result) or str(Path(args.plot).resolve())
    else:
        result = measure(args, ratios, log)
    common.report(result, args.json, table)
    return 0


def _methods(ratios: list[float], leading: int) -> list[dict[str, Any]]:
    near = min(ratios, key=lambda r: abs(r - 0.15)) if ratios else None
    return ([{"method": "full", "source": None, "ratio": None}, {"method": "prefix", "source": "engine", "ratio": None},
             {"method": "prefix", "source": "ucm", "ratio": None}, {"method": "naive", "source": "ucm", "ratio": 0.0}]
            + [{"method": "blend", "source": "ucm", "ratio": r, "select": "question"} for r in ratios]
            + ([{"method": "blend", "source": "ucm", "ratio": near, "select": "deviation"}] if near is not None else [])
            + [{"method": "leading", "source": "ucm", "ratio": None, "leading_tokens": leading},
               {"method": "naive", "source": "ucm", "ratio": 0.0, "context": "none"}]
            + ([{"method": "blend", "source": "ucm", "ratio": near, "select": "question", "context": "none"}]
               if near is not None else []))


def measure(args: argparse.Namespace, ratios: list[float], log) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ucm.accelerators.blend import BlendOptions
    from ucm.apps.demo.report import machine_line
    from ucm.apps.model import prepare
    from ucm.bench.engines.blend_tasks import rag_prompts
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.blend import ChunkBlender

    q = args.quick
    model_dir = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    source, prompts = rag_prompts(tok, prompts=args.prompts or (4 if q else 20), k=args.k or (4 if q else 6),
                                  pool=args.pool or (6 if q else 12),
                                  passage_tokens=args.passage_tokens or (128 if q else 512), seed=args.seed,
                                  document=args.document)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    layers = model.config.num_hidden_layers
    log(f"machine: {machine_line()}\n{len(prompts)} prompts of {len(prompts[0].spans)} passages from {source}, "
        f"{statistics.fmean(len(p.ids) for p in prompts):.0f} tokens on average; model {args.dtype}")
    work = Path(tempfile.mkdtemp(prefix="ucm-blend-"))
    chunk_bytes = 2 * layers * model.config.num_key_value_heads * model.config.head_dim * (
        4 if args.dtype == "float32" else 2) * BLOCK_TOKENS
    pool_blocks = (args.pool or 12) * -(-(args.passage_tokens or 512) // BLOCK_TOKENS) * 2 + 64
    cfg = {"block_tokens": BLOCK_TOKENS, "policy": {"name": "lru"},
           "tiers": [{"adapter": "dram", "capacity": pool_blocks * chunk_bytes, "options": {"prefault": False}},
                     {"adapter": "nvme", "capacity": 4 * pool_blocks * chunk_bytes, "options": {"path": str(work)}}]}
    methods = _methods(ratios, args.leading_tokens)
    per: dict[int, dict[str, list]] = {i: {"ttft": [], "kl": [], "agree": [], "needle": [], "two_hop": [],
                                           "work": [], "reads": []} for i in range(len(methods))}
    torch.set_grad_enabled(False)
    with UnifiedCache(cfg) as cache:
        conn = TransformersConnector(model, cache)
        blenders = {i: ChunkBlender(conn, BlendOptions(
            select="leading" if m["method"] == "leading" else m.get("select", "deviation"), ratio=m["ratio"] or 0.0,
            leading_tokens=m.get("leading_tokens", 16), context=m.get("context", "prefix")))
            for i, m in enumerate(methods)
            if m["method"] in ("naive", "blend", "leading")}
        system = prompts[0].ids[:prompts[0].system_tokens]
        sys_cache = model(input_ids=torch.tensor([system]), use_cache=True).past_key_values
        log("warming: every prompt's passages into ucm (one unmeasured blend each)")
        warm = [next(b for i, b in blenders.items() if methods[i].get("context", "prefix") == c)
                for c in ("prefix", "none")]
        for p in prompts:
            for b in warm:
                b.prefill(p.ids, p.spans)
        conn.wait_stores()
        for n, p in enumerate(prompts):
            ids = torch.tensor([p.ids])
            _quiet(conn, cache)
            ref_ttft, ref = _generate(ids, args.answer_tokens, lambda kw: model.generate(**kw))
            answer = ref.sequences[0, len(p.ids):].tolist()
            p_full = torch.log_softmax(torch.stack(ref.logits).float()[:, 0], dim=-1)
            for i, m in enumerate(methods):
                _quiet(conn, cache)  # the previous row's stores and the tiers' moves are not timed with this row
                before = _reads(cache)
                if m["method"] == "full":
                    ttft, out = ref_ttft, ref
                elif m["method"] == "prefix" and m["source"] == "engine":
                    ttft, out = _generate(ids, args.answer_tokens, lambda kw: model.generate(
                        past_key_values=copy.deepcopy(sys_cache), **kw))
                elif m["method"] == "prefix":
                    ttft, out = _generate(ids, args.answer_tokens, lambda kw: conn.generate(**kw))
                else:
                    b = blenders[i]
                    ttft, out = _generate(ids, args.answer_tokens,
                                          lambda kw, b=b, p=p: b.generate(kw.pop("input_ids"), p.spans, **kw))
                after = _reads(cache)
                # quality, teacher-forced; the prefix rows' is the engine's reuse of the system prompt (ucm's
                # prefix hits equal it token for token: tests/e2e/test_transformers_connector.py)
                if m["method"] == "full":
                    fwd, p_m = len(p.ids) * layers, p_full
                elif m["method"] == "prefix":
                    fwd = (len(p.ids) - len(system)) * layers
                    p_m = _forced(model, p.ids, answer, copy.deepcopy(sys_cache), len(system))
                else:
                    rep = b.last_report
                    fwd = rep.layer_tokens + (len(p.ids) - rep.blended_tokens) * layers
                    bc, rep2 = b.prefill(p.ids, p.spans)
                    p_m = _forced(model, p.ids, answer, bc, rep2.blended_tokens)
                text = tok.decode(out.sequences[0, len(p.ids):])
                d = per[i]
                d["ttft"].append(ttft)
                d["kl"].append(float((p_full.exp() * (p_full - p_m)).sum(-1).mean()))
                d["agree"].append(float((p_m.argmax(-1) == torch.tensor(answer)).float().mean()))
                (d["needle"] if p.kind == "needle" else d["two_hop"]).append(p.correct(text))
                d["work"].append(fwd / (len(p.ids) * layers))
                d["reads"].append({t: after[t] - before.get(t, 0) for t in after})
            log(f"prompt {n + 1}/{len(prompts)} ({p.kind}, {len(p.ids)} tokens): full {ref_ttft * 1000:.0f} ms, "
                + ", ".join(f"{label(m)} {per[i]['ttft'][-1] * 1000:.0f} ms" for i, m in enumerate(methods)
                            if m["method"] != "full"))
        conn.close()
    rows = [row(m, per[i], chunk_bytes) for i, m in enumerate(methods)]
    result = {"machine": machine_line(), "engine": "transformers", "dtype": args.dtype, "source": source,
              "workload": workload(prompts, args, args.passage_tokens or (128 if q else 512), BLOCK_TOKENS),
              "rows": rows}
    result["plot"] = plot(rows, Path(args.plot).resolve(), result) or str(Path(args.plot).resolve())
    return result


def _generate(ids: Any, new: int, call) -> tuple[float, Any]:
    """(seconds to the first token's logits, generate's output with its
    logits) of a greedy `call(kwargs)`."""
    from transformers import LogitsProcessor, LogitsProcessorList

    first: list[float] = []

    class _Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                first.append(time.perf_counter())
            return scores

    import torch

    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": new, "min_new_tokens": new,
          "do_sample": False, "output_logits": True, "return_dict_in_generate": True,
          "logits_processor": LogitsProcessorList([_Stamp()])}
    t0 = time.perf_counter()
    out = call(kw)
    return first[0] - t0, out


def _forced(model: Any, ids: list[int], answer: list[int], cache: Any, start: int) -> Any:
    """Log-probabilities of the next token at each answer position, with
    the answer teacher-forced after `cache` (which holds ids[:start])."""
    import torch

    rest = torch.tensor([ids[start:] + answer[:-1]])
    logits = model(input_ids=rest, past_key_values=cache, use_cache=True).logits[0, -len(answer):]
    return torch.log_softmax(logits.float(), dim=-1)


def _quiet(conn: Any, cache: Any) -> None:
    """Waits for the stores submitted so far and the tiers' write-backs."""
    conn.wait_stores()
    cache.flush()


def _reads(cache: Any) -> dict[str, int]:
    return {name: t["served_blocks"] for name, t in cache.stats()["tiers"].items()}


if __name__ == "__main__":
    sys.exit(common.main("python -m ucm.bench.engines.blend_bench", __doc__, _add_args, run))
