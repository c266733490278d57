"""`ucm bench blend --engine vllm`: the same workload and rows as the
transformers bench (blend_bench.py), on vLLM for CPU through UCMConnector
(ucm/connectors/vllm/blend.py), in this process.

One engine: `worker_cls` UcmCPUWorker, UCMConnector as `kv_consumer` (ucm
loads, saves no prompt block: a plain request is a full prefill every
time; chunk entries are stored by the blend itself), vLLM's prefix cache
on and emptied before every measured request. Every prompt's passages are
in ucm before the measured requests (one unmeasured blend per prompt).

Methods, each prompt in turn through every one:
- `full`: the prompt as a plain request;
- `prefix` (`source` `engine`): vLLM's own prefix cache holding the system
  prompt (its whole 128-token pages only);
- `naive`, `blend` at each ratio (`select: question`) and at the ratio
  nearest 15 % with `select: deviation`, `leading`: the prompt with its
  passages as `ucm_chunks` and the method as the request's `ucm_blend`
  options.

Per method: TTFT (vLLM's own first-token latency of the request,
`RequestOutput.metrics`), the answer (`--answer-tokens` greedy tokens, the
end of text held off) for needle and two-hop accuracy; and, teacher-forced
on the full prefill's answer (the prompt and answer as one prompt; vLLM's
prompt logprobs at the answer positions, each position's 256 most likely
tokens, a token outside them counted at the 256th's probability, an upper
bound), `kl` (full || method, over the full prefill's 256 most likely
tokens and one bucket for the rest's mass: a close lower bound of the
exact KL) and `greedy_agreement`. `recompute_share` counts layer tokens as
the transformers bench does, from the blend's own counters.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 256  # two vLLM-CPU pages
TOP_TOKENS = 256  # the full prefill's most likely tokens per answer position, on which methods are scored
SALT = "ucm-bench-blend"  # blended requests: vLLM's prefix cache is on (blend_request.py)
WORKER_CLS = "ucm.connectors.vllm.blend_worker.UcmCPUWorker"


def methods(ratios: list[float], leading: int) -> list[dict[str, Any]]:
    near = min(ratios, key=lambda r: abs(r - 0.15)) if ratios else None
    return ([{"method": "full", "source": None, "ratio": None}, {"method": "prefix", "source": "engine", "ratio": None},
             {"method": "naive", "source": "ucm", "ratio": 0.0}]
            + [{"method": "blend", "source": "ucm", "ratio": r, "select": "question"} for r in ratios]
            + ([{"method": "blend", "source": "ucm", "ratio": near, "select": "deviation"}] if near is not None else [])
            + [{"method": "leading", "source": "ucm", "ratio": None, "leading_tokens": leading}])


def _options(m: dict[str, Any]) -> dict[str, Any]:
    if m["method"] == "leading":
        return {"select": "leading", "leading_tokens": m["leading_tokens"]}
    return {"select": m.get("select", "deviation"), "ratio": m["ratio"]}


def measure(args: argparse.Namespace, ratios: list[float], log) -> dict[str, Any]:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the table or the JSON
    import torch
    import yaml
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import ucm
    from ucm.apps.demo.report import machine_line
    from ucm.apps.engine_env import bench_env
    from ucm.apps.model import prepare
    from ucm.bench.engines.blend_report import row, workload
    from ucm.bench.engines.blend_tasks import rag_prompts

    work = Path(tempfile.mkdtemp(prefix="ucm-blend-vllm-"))
    os.environ.update(bench_env(work))
    q = args.quick
    model_dir = str(prepare("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoConfig.from_pretrained(model_dir)
    layers = hf.num_hidden_layers
    source, prompts = rag_prompts(tok, prompts=args.prompts or (4 if q else 20), k=args.k or (4 if q else 6),
                                  pool=args.pool or (6 if q else 12),
                                  passage_tokens=args.passage_tokens or (256 if q else 512), seed=args.seed,
                                  document=args.document)
    log(f"machine: {machine_line()}\n{len(prompts)} prompts of {len(prompts[0].spans)} passages from {source}, "
        f"{statistics.fmean(len(p.ids) for p in prompts):.0f} tokens on average; vLLM for CPU, {args.dtype}")
    block_bytes = 2 * layers * hf.num_key_value_heads * (hf.hidden_size // hf.num_attention_heads) * (
        4 if args.dtype == "float32" else 2) * BLOCK_TOKENS
    pool_blocks = (args.pool or 12) * -(-(args.passage_tokens or 512) // BLOCK_TOKENS) * 2 + 16
    cfg = {"block_tokens": BLOCK_TOKENS, "policy": {"name": "lru"},
           "tiers": [{"adapter": "dram", "capacity": pool_blocks * block_bytes, "options": {"prefault": False}}],
           "service": {"name": f"bench-blend-{os.getpid()}", "socket": str(work / "ucm.sock")}}
    (work / "ucm.yaml").write_text(yaml.safe_dump(cfg))
    client = ucm.connect(str(work / "ucm.yaml"))  # the service the engine's connector uses, up for the run
    kv = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                          kv_role="kv_consumer", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"ucm_config": str(work / "ucm.yaml")})
    longest = max(len(p.ids) for p in prompts) + args.answer_tokens + 8
    llm = LLM(model=model_dir, dtype=args.dtype, max_model_len=max(2048, longest), enable_prefix_caching=True,
              max_num_batched_tokens=max(2048, longest), max_logprobs=TOP_TOKENS, disable_log_stats=False, seed=0,
              kv_transfer_config=kv, worker_cls=WORKER_CLS)
    meths = methods(ratios, args.leading_tokens)

    def counters() -> dict[str, int]:
        return llm.collective_rpc("ucm_blend_stats")[0]

    def request(ids: list[int], m: dict[str, Any], p, **sp: Any):
        """One measured request of method `m` (vLLM's prefix cache emptied first)."""
        llm.reset_prefix_cache()
        params: dict[str, Any] = {}
        salt = None
        if m["method"] in ("naive", "blend", "leading"):
            params = {"kv_transfer_params": {"ucm_chunks": [list(s) for s in p.spans], "ucm_blend": _options(m)}}
            salt = SALT
        elif m["method"] == "prefix":
            llm.generate([{"prompt_token_ids": p.ids[:p.system_tokens]}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
        prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
        return llm.generate([prompt], SamplingParams(temperature=0.0, extra_args=params or None, **sp),
                            use_tqdm=False)[0]

    vocab = max(hf.vocab_size, len(tok))

    def forced(p, answer: list[int], m: dict[str, Any]) -> Any:
        """Log-probabilities at each answer position, the answer
        teacher-forced after the prompt: vLLM's TOP_TOKENS most likely
        tokens per position, and for every other token the least of them
        (an upper bound)."""
        o = request(p.ids + answer, m, p, max_tokens=1, prompt_logprobs=TOP_TOKENS, skip_reading_prefix_cache=False,
                    detokenize=False)
        rows = o.prompt_logprobs[len(p.ids):]
        if len(rows) != len(answer) or not all(rows):
            raise RuntimeError(f"vLLM scored {sum(bool(d) for d in rows)} of {len(answer)} answer positions")
        out = torch.empty((len(answer), vocab))
        for i, d in enumerate(rows):
            lp = torch.tensor([x.logprob for x in d.values()])
            out[i] = lp.min()
            out[i, list(d)] = lp
        return out

    per = {i: {"ttft": [], "kl": [], "agree": [], "needle": [], "two_hop": [], "work": [], "reads": []}
           for i in range(len(meths))}
    log("warming: every prompt's passages into ucm (one unmeasured blend each)")
    for p in prompts:
        request(p.ids, meths[2], p, max_tokens=1)
    for n, p in enumerate(prompts):
        ref = request(p.ids, meths[0], p, max_tokens=args.answer_tokens, ignore_eos=True)
        answer = list(ref.outputs[0].token_ids)
        p_full = forced(p, answer, meths[0])
        top = p_full.topk(TOP_TOKENS, dim=-1).indices  # the tokens the methods are scored on
        for i, m in enumerate(meths):
            before_reads, before = _reads(client), counters()
            out = ref if i == 0 else request(p.ids, m, p, max_tokens=args.answer_tokens, ignore_eos=True)
            got = {k: v - before.get(k, 0) for k, v in counters().items()}
            reads = {t: v - before_reads.get(t, 0) for t, v in _reads(client).items()}
            p_m = p_full if i == 0 else forced(p, answer, m)
            d = per[i]
            d["ttft"].append(out.metrics.first_token_latency)
            d["kl"].append(_kl(p_full, p_m, top))
            d["agree"].append(float((p_m.argmax(-1) == torch.tensor(answer)).float().mean()))
            (d["needle"] if p.kind == "needle" else d["two_hop"]).append(p.correct(tok.decode(out.outputs[0].token_ids)))
            d["work"].append(_work(m, got, p, layers, args))
            d["reads"].append(reads)
        log(f"prompt {n + 1}/{len(prompts)} ({p.kind}, {len(p.ids)} tokens): "
            + ", ".join(f"{row(m, per[i], block_bytes, 'vllm')['label']} {per[i]['ttft'][-1] * 1000:.0f} ms"
                        for i, m in enumerate(meths)))
    llm.llm_engine.engine_core.shutdown()
    rows = [row(m, per[i], block_bytes, "vllm") for i, m in enumerate(meths)]
    return {"machine": machine_line(), "engine": "vllm", "dtype": args.dtype, "source": source,
            "workload": workload(prompts, args, args.passage_tokens or (256 if q else 512), BLOCK_TOKENS),
            "rows": rows}


def _work(m: dict[str, Any], got: dict[str, int], p, layers: int, args: argparse.Namespace) -> float:
    """Layer-token work of the request's prefill over the full prefill's."""
    total = len(p.ids) * layers
    if m["method"] == "full":
        return 1.0
    if m["method"] == "prefix":
        cached = p.system_tokens // 128 * 128
        return (len(p.ids) - cached) * layers / total
    n, s0 = got.get("blended_tokens", 0), p.spans[0][0]
    checked = 1 if m["method"] == "blend" and m.get("select") == "deviation" and m["ratio"] > 0 else 0
    blended = s0 * layers + checked * (n - s0) + (layers - checked) * got.get("recomputed_tokens", 0)
    return (blended + got.get("probe_layer_tokens", 0) + (len(p.ids) - n) * layers) / total


def _kl(p_full: Any, p_m: Any, top: Any) -> float:
    """Mean over answer positions of KL(full || method), over the full
    prefill's TOP_TOKENS most likely tokens and one bucket for the rest
    (a lower bound of the exact KL, equal to it as the rest's mass goes
    to 0)."""
    lp, lq = p_full.gather(1, top), p_m.gather(1, top)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    rest_p = (1 - lp.exp().sum(-1)).clamp(min=1e-12)
    rest_q = (1 - lq.exp().sum(-1)).clamp(min=1e-12)
    kl += rest_p * (rest_p.log() - rest_q.log())
    return float(kl.mean())


def _reads(client: Any) -> dict[str, int]:
    try:
        return {name: t["served_blocks"] for name, t in client.stats()["tiers"].items()}
    except Exception:
        return {}
