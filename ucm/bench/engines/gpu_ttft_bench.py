"""`ucm bench gpu-ttft`: time to first token of a long-document hit in
transformers on a GPU, ucm against transformers' own prefix reuse.

The model is a Llama-architecture transformer with a real model's shapes
(by default a 1B-parameter model's: 16 layers, hidden 2048, 32 heads, 8 KV
heads, head 64, vocab 128256) and random weights drawn with a seed on the
device: time to first token depends on the
shapes, not on what the weights learnt, and no weights have to be
downloaded. One document of `--doc-tokens` random token ids is asked
`--rounds` times with another question; per round, in turn:

- `no_cache`: plain `generate` of document + question (a full prefill);
- `reference_reuse`: transformers' own prefix reuse, a DynamicCache of the
  document kept by the caller, a copy cropped to the length ucm restores
  (made before the clock starts), then `generate`;
- `ucm_dram_hit`: the transformers connector over an in-process cache with
  a DRAM tier, no hbm front: the document's blocks restored from host
  memory to the device;
- `ucm_hbm_hit`: the connector with an hbm front (device memory) over the
  same cache, holding the document's blocks: restored device to device.

`max_new_tokens=1`, greedy, the clock between two device synchronizations.
`outputs_equal`: every ucm hit's first token equals the reference's.
Figures are medians over the rounds, in seconds, with every sample.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any, Callable

from ucm.bench import common
from ucm.errors import ArgumentError
from ucm.progress import bar

VARIANTS = ("no_cache", "reference_reuse", "ucm_dram_hit", "ucm_hbm_hit")


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "gpu-ttft", help="TTFT of a long-document hit in transformers on a GPU: ucm against "
                                           "transformers' own prefix reuse and a full prefill",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_device_flag(p)
    p.add_argument("--layers", type=int, default=16, help="layers (default 16, Llama-3.2-1B)")
    common.add_counts(p, hidden=(2048, "hidden size"), heads=(32, "attention heads"), kv_heads=(8, "KV heads"),
                      intermediate=(8192, "MLP size"), vocab=(128256, "vocabulary"),
                      doc_tokens=(8192, "tokens of the document"), block_tokens=(256, "tokens per ucm block"),
                      rounds=(5, "rounds; figures are medians"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    common.add_json_flag(p)


def _check(args: argparse.Namespace) -> None:
    common.require_positive(args, ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "doc_tokens",
                                   "block_tokens", "rounds"))
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ArgumentError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}), and --heads "
                            f"of --kv-heads ({args.kv_heads})")
    if args.doc_tokens < args.block_tokens:
        raise ArgumentError(f"--doc-tokens ({args.doc_tokens}) must hold at least one block "
                            f"(--block-tokens {args.block_tokens})")


def gpu_ttft(device: str = "auto", layers: int = 16, hidden: int = 2048, heads: int = 32, kv_heads: int = 8,
             intermediate: int = 8192, vocab: int = 128256, doc_tokens: int = 8192, block_tokens: int = 256,
             rounds: int = 5, dtype: str = "bfloat16", seed: int = 0,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Runs the bench (module docstring) and returns its figures."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector, build_namespace

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return time.perf_counter() - t0, out

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=max(8192, doc_tokens + 64),
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with dev:
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model_id = f"random-llama-{layers}x{hidden}-kv{kv_heads}-v{vocab}-seed{seed}"
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, vocab, (1, doc_tokens), generator=g)
    questions = [torch.randint(3, vocab, (1, 16), generator=g) for _ in range(rounds + 1)]
    prompts = [torch.cat([doc, q], 1).to(dev) for q in questions]
    gen = dict(max_new_tokens=1, do_sample=False)
    block_bytes = build_namespace(model, block_tokens, model_id)[1].block_bytes
    blocks = doc_tokens // block_tokens
    samples: dict[str, list[float]] = {k: [] for k in VARIANTS}
    eq = {"dram_hit": True, "hbm_hit": True}
    with torch.no_grad(), UnifiedCache({"block_tokens": block_tokens, "tiers": [
            {"adapter": "dram", "capacity": 2 * blocks * block_bytes + (64 << 20), "options": {"prefault": True}}]}) \
            as cache:
        dram = TransformersConnector(model, cache, model_id=model_id, hbm_bytes=0)
        front = TransformersConnector(model, cache, model_id=model_id, hbm_bytes=2 * blocks * block_bytes + (1 << 20))
        doc_dev = doc.to(dev)
        model.generate(doc_dev[:, :64], **gen)  # one-time costs (kernels, allocator) out of every variant
        own = DynamicCache(config=model.config)
        model(doc_dev, past_key_values=own)  # the caller's own cache of the document
        dram.generate(prompts[0], **gen)  # stores the document's blocks
        dram.wait_stores()
        probe = dram.cache_for(prompts[0])
        restored = probe.restored_tokens
        probe.finish(0)
        front.generate(prompts[0], **gen)  # loads them once, which puts them into the front
        front.wait_stores()
        for r in bar(range(1, rounds + 1), desc="gpu-ttft rounds", unit="round"):
            log(f"[bench gpu-ttft] round {r}/{rounds}")
            ids = prompts[r]
            ref = copy.deepcopy(own)
            ref.crop(restored - ref.get_seq_length())
            t, want = timed(lambda: model.generate(ids, past_key_values=ref, **gen))
            samples["reference_reuse"].append(t)
            t, out = timed(lambda: dram.generate(ids, **gen))
            samples["ucm_dram_hit"].append(t)
            eq["dram_hit"] &= torch.equal(out, want)
            t, out = timed(lambda: front.generate(ids, **gen))
            samples["ucm_hbm_hit"].append(t)
            eq["hbm_hit"] &= torch.equal(out, want)
            t, _ = timed(lambda: model.generate(ids, **gen))
            samples["no_cache"].append(t)
            dram.wait_stores()
            front.wait_stores()
        stats = {"dram": dram.stats(), "hbm_front": front.stats()}
        dram.close()
        front.close()
    med = {k: round(statistics.median(v), 4) for k, v in samples.items()}
    return {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                  "intermediate": intermediate, "vocab": vocab, "dtype": dtype, "weights": "random, seed %d" % seed},
        "doc_tokens": doc_tokens, "block_tokens": block_tokens, "block_bytes": block_bytes,
        "restored_tokens": restored, "rounds": rounds,
        **{f"{k}_ttft_s": v for k, v in med.items()},
        "ratios": {"ucm_dram_hit_over_reference": round(med["ucm_dram_hit"] / med["reference_reuse"], 3),
                   "ucm_hbm_hit_over_reference": round(med["ucm_hbm_hit"] / med["reference_reuse"], 3),
                   "ucm_dram_hit_over_no_cache": round(med["ucm_dram_hit"] / med["no_cache"], 3),
                   "reference_over_no_cache": round(med["reference_reuse"] / med["no_cache"], 3)},
        "outputs_equal": all(eq.values()), "outputs_equal_detail": eq,
        "samples_ttft_s": {k: [round(x, 5) for x in v] for k, v in samples.items()},
        "connector": stats,
    }


def run(args: argparse.Namespace) -> int:
    _check(args)
    res = gpu_ttft(args.device, args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab,
                   args.doc_tokens, args.block_tokens, args.rounds, args.dtype, log=common.progress_log(True))
    common.report(res, args.json, _table, sort_keys=True)
    return 0 if res["outputs_equal"] else 1


def _table(res: dict[str, Any]) -> str:
    lines = [f"{res['device']}: {res['doc_tokens']}-token document, {res['restored_tokens']} tokens restored, "
             f"median of {res['rounds']} (s)"]
    lines += [f"{k:<18}{res[k + '_ttft_s']:>10.4f}" for k in VARIANTS]
    lines.append(f"outputs equal: {res['outputs_equal']}")
    return "\n".join(lines)
