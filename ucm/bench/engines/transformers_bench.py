"""`ucm bench transformers`: time to first token in Hugging Face transformers
(CPU) with and without ucm.

The model of `--model` in float32 and bfloat16 (`--dtypes`). `--docs`
documents of exactly `--doc-tokens` token ids (deterministic pseudo-random
ids, as `ucm bench vllm` uses), each asked twice: pass 1 with one question,
pass 2 with another, so pass 2 can reuse the document's full blocks. One
prompt at a time, greedy, `max_new_tokens=1` (TTFT = the whole call, the
connector's `cache_for` included), torch pinned to `--threads` threads for
every variant. Per dtype, in one process, `--repeat` rounds; in each round,
per document, the variants run in turn, so that these shared CPUs' slow
moments hit all of them alike (the hit trio `--hit-repeat` times):

- transformers' own prefix reuse (the reference): a DynamicCache of the
  pass-1 prompt kept by the caller, a copy of it cropped to the length ucm
  restores (made before the clock starts), then `generate` of pass 2;
- ucm DRAM hit: pass 2 through the connector, the document's blocks in DRAM
  (staged back with `prefetch` beforehand, off the clock;
  `tiers_before_dram_phase`);
- ucm NVMe-only hit: the same after filler blocks pushed every block of the
  document out of DRAM (`locate` says nvme: `tiers_before_nvme_phase`), so
  the hit is staged from NVMe;
- ucm cold: the pass-1 prompt through the connector on a cache that misses
  (a fresh DRAM-only cache every round), stores after prefill included as
  they run (asynchronously; waited for off the clock);
- no cache: plain `generate` of the pass-1 prompt (a full prefill).

The cache is an in-process UnifiedCache (DRAM with 20 % headroom over an
O_DIRECT NVMe log in a temporary directory, lru). `outputs_equal`: the
first token of every ucm cold run equals plain generate's; of every hit,
the reference's; and an 8-token greedy continuation from a DRAM hit equals
the reference's. Figures are medians over documents x rounds (x hit
repeats), in seconds, with their spread (`spread_ttft_s`: min, quartiles,
max); `ratios` are of medians, `paired_ratios` the median and quartiles of
the ratio of each sample to its round's reference (or no-cache run) for the
same document, measured seconds apart.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ucm.bench import common
from ucm.bench.blocks import push_below_dram, tier_counts
from ucm.bench.engines.ttft_workload import CHECK_TOKENS, documents  # the same workload as ucm bench vllm
from ucm.progress import bar


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "transformers", help="TTFT in transformers: no cache, own prefix reuse, ucm cold/DRAM/NVMe",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_counts(p, docs=(2, "documents"), doc_tokens=(2048, "tokens per document"),
                      block_tokens=(256, "tokens per ucm block"))
    p.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes (default float32,bfloat16)")
    common.add_counts(p, repeat=(5, "rounds of every measurement"),
                      hit_repeat=(3, "the hit trio (reference, DRAM, NVMe) per document and round"))
    p.add_argument("--threads", type=int, default=None, help="torch threads for every variant (default: CPUs)")
    common.add_model_flag(p)
    p.add_argument("--quick", action="store_true", help="1 document of 192 tokens, 64-token blocks, 1 round")
    common.add_json_flag(p)


def _cache_config(work: Path, block_bytes: int, blocks: int, block_tokens: int, evictions: int = 4) -> dict:
    """DRAM for every document's blocks with room; NVMe for them and the
    filler blocks of `evictions` pushes out of DRAM between two uses of a
    document (lru drops the oldest: a document's blocks must not be)."""
    dram = max(8 << 20, (blocks + 2) * block_bytes * 3 // 2)
    region = max(16 << 20, -(-4 * block_bytes // (1 << 20)) << 20)  # a few blocks per region, MiB-aligned
    return {
        "block_tokens": block_tokens,
        "tiers": [{"adapter": "dram", "capacity": dram, "headroom": 0.2, "options": {"prefault": False}},
                  {"adapter": "nvme", "capacity": max(256 << 20, 8 * dram, 16 * region, (2 * evictions + 4) * dram),
                   "options": {"path": str(work), "region_size": region, "direct_io": True}}],
        "policy": {"name": "lru"},
    }


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _quantiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"min": round(min(xs), 4), "p25": round(q[0], 4), "median": round(q[1], 4), "p75": round(q[2], 4),
            "max": round(max(xs), 4), "n": len(xs)}


def measure_dtype(model_dir: str, dtype_name: str, pass1: list[list[int]], pass2: list[list[int]],
                  block_tokens: int, repeat: int, log: Callable[..., None], hit_repeat: int = 1) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from ucm.cache.unified import UnifiedCache
    from ucm.keys import block_keys
    from ucm.connectors.transformers import TransformersConnector, build_namespace

    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-hf-"))
    gen = dict(max_new_tokens=1, do_sample=False)
    names = ("no_cache", "ucm_cold", "reference_reuse", "ucm_dram_hit", "ucm_nvme_hit")
    samples: dict[str, list[float]] = {k: [] for k in names}
    paired: dict[str, list[float]] = {"ucm_cold_over_no_cache": [], "ucm_dram_hit_over_reference": [],
                                      "ucm_nvme_hit_over_reference": []}
    eq: dict[str, bool] = {"cold": True, "dram_hit": True, "nvme_hit": True, f"dram_hit_{CHECK_TOKENS}_tokens": True}
    restored, tiers_before_dram, tiers_before_nvme = [], [], []
    try:
        block_bytes = build_namespace(model, block_tokens)[1].block_bytes
        blocks = sum(len(p) // block_tokens for p in pass1)
        cfg = _cache_config(work, block_bytes, blocks, block_tokens, evictions=len(pass1) * hit_repeat + 1)
        with UnifiedCache(cfg) as cache, torch.no_grad():
            conn = TransformersConnector(model, cache, block_tokens=block_tokens)
            ids1 = [torch.tensor([p]) for p in pass1]
            ids2 = [torch.tensor([p]) for p in pass2]
            model.generate(ids1[0][:, :64], **gen)  # one-time costs out of every variant
            refs, firsts = [], []
            for a in ids1:  # the caller's own DynamicCache of pass 1, and ucm's copy of its blocks
                dc = DynamicCache(config=model.config)
                model(a, past_key_values=dc)
                refs.append(dc)
                conn.generate(a, **gen)
            conn.wait_stores()
            doc_keys = [block_keys(conn.namespace, p) for p in pass2]
            for d, b in enumerate(ids2):  # the length ucm restores, for the reference's crop
                probe = conn.cache_for(b)
                restored.append(probe.restored_tokens)
                probe.finish(0)

            def reference(d: int) -> tuple[float, Any]:
                ref = copy.deepcopy(refs[d])
                ref.crop(restored[d] - ref.get_seq_length())
                return _timed(lambda: model.generate(ids2[d], past_key_values=ref, **gen))

            for d in range(len(ids2)):
                firsts.append(reference(d)[1])
            for rnd in bar(range(repeat), desc=f"{dtype_name} rounds", unit="round"):
                log(f"[bench transformers] {dtype_name} round {rnd + 1}/{repeat}")
                # Cold runs on a cache of their own (a fresh one each round: every lookup misses), so their
                # stores never push the documents out of the hit phases' DRAM.
                cold_cache = UnifiedCache({"block_tokens": block_tokens, "tiers": [
                    {"adapter": "dram", "capacity": max(8 << 20, (blocks + 2) * block_bytes * 2),
                     "options": {"prefault": False}}]})
                cold = TransformersConnector(model, cold_cache, block_tokens=block_tokens)
                for d, (a, b) in enumerate(zip(ids1, ids2)):
                    keys = doc_keys[d]
                    for _ in range(hit_repeat):
                        t_ref, _ = reference(d)
                        samples["reference_reuse"].append(t_ref)
                        cache.prefetch(keys).wait(120)  # the DRAM hit hits DRAM (an NVMe hit left them below)
                        cache.flush()
                        tiers_before_dram.append(tier_counts(cache.locate(keys)))
                        t, out = _timed(lambda: conn.generate(b, **gen))
                        samples["ucm_dram_hit"].append(t)
                        paired["ucm_dram_hit_over_reference"].append(t / t_ref)
                        eq["dram_hit"] &= torch.equal(out, firsts[d])
                        conn.wait_stores()
                        tiers_before_nvme.append(tier_counts(push_below_dram(cache, keys, block_bytes, limit=400,
                                                                             per_round=4)))
                        cache.flush()
                        t, out = _timed(lambda: conn.generate(b, **gen))
                        samples["ucm_nvme_hit"].append(t)
                        paired["ucm_nvme_hit_over_reference"].append(t / t_ref)
                        eq["nvme_hit"] &= torch.equal(out, firsts[d])
                        conn.wait_stores()
                    t_cold, out = _timed(lambda: cold.generate(a, **gen))
                    samples["ucm_cold"].append(t_cold)
                    cold.wait_stores()
                    t, plain = _timed(lambda: model.generate(a, **gen))
                    samples["no_cache"].append(t)
                    paired["ucm_cold_over_no_cache"].append(t_cold / t)
                    eq["cold"] &= torch.equal(out, plain)
                cold.close()
                cold_cache.close()
            for d, b in enumerate(ids2):  # a longer greedy continuation, off the clock
                cache.prefetch(doc_keys[d]).wait(120)
                ref = copy.deepcopy(refs[d])
                ref.crop(restored[d] - ref.get_seq_length())
                want = model.generate(b, past_key_values=ref, max_new_tokens=CHECK_TOKENS, do_sample=False)
                got = conn.generate(b, max_new_tokens=CHECK_TOKENS, do_sample=False)
                eq[f"dram_hit_{CHECK_TOKENS}_tokens"] &= torch.equal(got, want)
            connector_stats = conn.stats()
            conn.close()
            cache_stats = {k: v for k, v in cache.stats().items() if not isinstance(v, dict)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: round(statistics.median(v), 4) for k, v in samples.items()}
    return {
        "dtype": dtype_name, "block_bytes": block_bytes, "restored_tokens": restored,
        **{f"{k}_ttft_s": v for k, v in med.items()},
        "ratios": {
            "ucm_cold_over_no_cache": round(med["ucm_cold"] / med["no_cache"], 3),
            "ucm_dram_hit_over_reference": round(med["ucm_dram_hit"] / med["reference_reuse"], 3),
            "ucm_nvme_hit_over_reference": round(med["ucm_nvme_hit"] / med["reference_reuse"], 3),
            "reference_over_no_cache": round(med["reference_reuse"] / med["no_cache"], 3),
        },
        "paired_ratios": {k: {q: round(x, 3) for q, x in _quantiles(v).items() if q in ("p25", "median", "p75")}
                          for k, v in paired.items()},
        "spread_ttft_s": {k: _quantiles(v) for k, v in samples.items()},
        "outputs_equal": all(eq.values()), "outputs_equal_detail": eq,
        "tiers_before_dram_phase": tiers_before_dram, "tiers_before_nvme_phase": tiers_before_nvme,
        "samples_not_all_in_tier": {"dram": sum(set(t) != {"dram"} for t in tiers_before_dram),
                                    "nvme": sum(set(t) != {"nvme"} for t in tiers_before_nvme)},
        "samples_ttft_s": {k: [round(x, 4) for x in v] for k, v in samples.items()},
        "connector": connector_stats, "cache": cache_stats,
    }


def measure(docs: int, doc_tokens: int, block_tokens: int, dtypes: list[str], repeat: int,
            model_name: str = "smollm2", log: Callable[..., None] = print, hit_repeat: int = 1,
            threads: Optional[int] = None) -> dict[str, Any]:
    if repeat < 1 or hit_repeat < 1 or docs < 1 or doc_tokens < block_tokens:
        raise ValueError(f"need --repeat >= 1, --hit-repeat >= 1, --docs >= 1 and --doc-tokens >= --block-tokens; "
                         f"got {repeat}, {hit_repeat}, {docs}, {doc_tokens} < {block_tokens}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer

    from ucm.apps.model import prepare

    torch.set_num_threads(threads or os.cpu_count() or 1)  # the same for every variant
    model_dir = str(prepare(model_name))
    pass1, pass2, _ = documents(AutoTokenizer.from_pretrained(model_dir), docs, doc_tokens)
    out: dict[str, Any] = {"docs": docs, "doc_tokens": doc_tokens, "pass1_tokens": len(pass1[0]),
                           "pass2_tokens": len(pass2[0]), "block_tokens": block_tokens, "repeat": repeat,
                           "hit_repeat": hit_repeat, "statistic": "median", "torch_threads": torch.get_num_threads(),
                           "order": "per round and document: (reference, ucm DRAM hit, ucm NVMe hit) x hit_repeat, "
                                    "ucm cold, no cache",
                           "load_average_start": [round(x, 2) for x in os.getloadavg()], "by_dtype": {}}
    for name in bar(dtypes, desc="bench transformers", unit="dtype"):
        log(f"[bench transformers] {name} ...")
        out["by_dtype"][name] = measure_dtype(model_dir, name, pass1, pass2, block_tokens, repeat, log, hit_repeat)
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out["outputs_equal"] = all(r["outputs_equal"] for r in out["by_dtype"].values())
    return out


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.docs, args.doc_tokens, args.block_tokens, args.repeat, args.hit_repeat = 1, 192, 64, 1, 1
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not dtypes:
        print(f"ucm bench transformers: --dtypes must name float32, bfloat16 or float16, got {args.dtypes!r}",
              file=sys.stderr)
        return 2
    return common.run_measured(
        args, "transformers", lambda log: measure(args.docs, args.doc_tokens, args.block_tokens, dtypes, args.repeat,
                                                  args.model, log=log, hit_repeat=args.hit_repeat,
                                                  threads=args.threads), table)


def table(r: dict[str, Any]) -> str:
    """Per dtype: the medians, their ratios and the paired ratios."""
    lines = [f"{'dtype':9s} {'no cache':>9s} {'ucm cold':>9s} {'own reuse':>9s} {'ucm DRAM':>9s} {'ucm NVMe':>9s} "
             f"{'cold/none':>9s} {'DRAM/own':>9s} {'NVMe/own':>9s} same output"]
    for name, d in r["by_dtype"].items():
        q = d["ratios"]
        lines.append(f"{name:9s} {d['no_cache_ttft_s']:8.3f}s {d['ucm_cold_ttft_s']:8.3f}s "
                     f"{d['reference_reuse_ttft_s']:8.3f}s {d['ucm_dram_hit_ttft_s']:8.3f}s "
                     f"{d['ucm_nvme_hit_ttft_s']:8.3f}s {q['ucm_cold_over_no_cache']:9.3f} "
                     f"{q['ucm_dram_hit_over_reference']:9.3f} {q['ucm_nvme_hit_over_reference']:9.3f} "
                     f"{d['outputs_equal']}")
        pr = {k: v["median"] for k, v in d["paired_ratios"].items()}
        lines.append(f"{'':9s} {'paired ratios (median):':>49s} {pr['ucm_cold_over_no_cache']:9.3f} "
                     f"{pr['ucm_dram_hit_over_reference']:9.3f} {pr['ucm_nvme_hit_over_reference']:9.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(common.main("python -m ucm.bench.engines.transformers_bench", __doc__, _add_args, run))
