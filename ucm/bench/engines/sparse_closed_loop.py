"""The closed-loop part of `ucm bench sparse`: selectors and budgets run
through the real transformers sparse decode path and compared with dense
decode of the same model.

Setup: a `UnifiedCache` and a `TransformersConnector` over the model
(float32, eager attention). Dense references go through the connector
without sparse decode: the first call prefills densely and stores the
prompt's blocks. `--tier dram` (default): one DRAM tier large enough for
every prompt of the run, so every sparse run restores the prefix from ucm
(prefill of the last, partial block only) and fetches its selected pages
from DRAM. `--tier nvme`: a DRAM tier of 4 blocks over an NVMe tier (a
temporary directory, page cache allowed); the prompt's blocks sit on NVMe,
a restore is staged through DRAM in parts (a hit longer than DRAM), which
leaves its last blocks in DRAM, and the selected pages are read by ranges
from NVMe or from those (`read_ranges`; ucm/connectors/transformers/
sparse.py, sparse_fetch.py).

Per selector, budget and `--reselect-every` value s (default 1: a
selection per step and layer; s > 1 holds each layer's selection for s
steps, the pages it already holds reused), with a fresh `SparseDecoder`:
- greedy: `new_tokens + 1` tokens decoded greedily; the first comes from
  the (dense) prefill, the next `new_tokens` from sparse decode steps.
  `greedy_agreement` is the share of those positions whose token equals
  dense greedy's; `greedy_prefix` the share before the first difference;
- teacher-forced: the same steps with dense greedy's tokens forced as
  inputs; per step the KL divergence KL(dense || sparse) of the next-token
  distributions and whether their top-1 tokens agree;
- bytes per decoded token, from the greedy runs' counters: read from each
  tier (the K and V of the selected pages a layer did not already hold
  from its last selection, `bytes_read`; `pages_read` and `pages_reused`
  count them); with `--tier nvme` also
  `nvme_medium_bytes_per_token`, what the NVMe adapter read from its file
  during the greedy run: the verified chunks covering the spans, and what
  a restore attempt staged; a block still in the adapter's write buffer is
  read from memory and not counted), attended from the
  resident tensors (sink, local window, tail), and what dense decode
  attends (every context token's K and V of every layer); `bytes_share` is
  attended over dense, `tier_bytes_share` the tiers' part over dense;
- passkey (sparse_tasks.py): for each length where dense answers at least
  80 % of the tasks, the share the sparse decode answers; the haystack is
  the prefill, the question is decoded token by token (teacher-forced),
  then the answer greedily, so both question and answer go through sparse
  steps. Below 80 % the length is reported as dense's accuracy only.

Runs in the caller's thread, under `torch.no_grad()`.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

PASSKEY_MIN_DENSE = 0.8
ANSWER_TOKENS = 7


class ForceTokens:
    """A logits processor: at generated position i < len(tokens), only
    `tokens[i]` may be chosen; later positions are left alone."""

    def __init__(self, prompt_len: int, tokens: list[int]) -> None:
        self.prompt_len, self.tokens = prompt_len, list(tokens)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        i = input_ids.shape[1] - self.prompt_len
        if i < len(self.tokens):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.tokens[i]] = 0.0
            return forced
        return scores


def _generate(gen: Callable[..., Any], ids: Any, new: int, force: Optional[list[int]] = None) -> tuple[list, list]:
    """(generated tokens, raw logits per generated position)."""
    from transformers import LogitsProcessorList

    procs = LogitsProcessorList([ForceTokens(ids.shape[1], force)] if force else [])
    out = gen(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, logits_processor=procs,
              output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), [l[0].float() for l in out.logits]


def _kl_top1(dense: list, sparse: list) -> tuple[float, float]:
    import torch

    kls, agree = [], []
    for d, s in zip(dense, sparse):
        pd, ps = torch.log_softmax(d.double(), -1), torch.log_softmax(s.double(), -1)
        kls.append(float((pd.exp() * (pd - ps)).sum()))
        agree.append(int(d.argmax()) == int(s.argmax()))
    return sum(kls) / len(kls), sum(agree) / len(agree)


def _bytes(stats: dict[str, Any], token_layer_bytes: int) -> dict[str, Any]:
    steps = max(1, stats["decode_steps"])
    tiers = {t: round(b, 1) for t, b in stats.get("bytes_read_per_token", {}).items()}
    attended = stats["attended_tokens"] * token_layer_bytes / steps
    dense = stats["context_tokens"] * token_layer_bytes / steps
    return {"bytes_per_token": tiers, "resident_bytes_per_token": round(attended - sum(tiers.values()), 1),
            "dense_bytes_per_token": round(dense, 1), "bytes_share": round(attended / dense, 4) if dense else None,
            "tier_bytes_share": round(sum(tiers.values()) / dense, 4) if dense else None}


def closed_loop(model_dir: str, tok: Any, ids: Any, text: str, args: argparse.Namespace,
                log: Callable[..., None]) -> dict[str, Any]:
    from ucm.accelerators.sparse import Budget, SparseOptions
    from ucm.bench.engines.sparse_setup import budget_name, budgets_of, load_model, reselect_every
    from ucm.bench.engines.sparse_tasks import passkey_tasks
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.namespace import kv_shape
    from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder

    import torch

    t_start = time.perf_counter()
    new = args.new_tokens
    samples = getattr(args, "samples", 1)
    if samples * args.context > ids.shape[1]:
        raise ValueError(f"{samples} prompts of {args.context} tokens need {samples * args.context} tokens; "
                         f"the document has {ids.shape[1]}")
    prompts = [ids[:, i * args.context:(i + 1) * args.context] for i in range(samples)]
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    tasks = {L: passkey_tasks(tok, text, L, args.passkey_samples, args.seed,
                              getattr(args, "passkey_haystack", "document")) for L in lengths}
    model = load_model(model_dir, "eager", args.layers)
    bt = args.block_tokens
    n_layers, kv_heads, head_dim = kv_shape(model)
    block_bytes = n_layers * 2 * kv_heads * bt * head_dim * 4
    blocks = samples * args.context // bt + sum(len(ts) * (L // bt + 1) for L, ts in tasks.items())
    cap_mib = max(64, (blocks + 8) * block_bytes * 5 // 4 >> 20)
    work = None
    if args.tier == "nvme":
        import tempfile

        work = tempfile.TemporaryDirectory(prefix="ucm-sparse-nvme-")
        tiers = [{"adapter": "dram", "capacity": 4 * block_bytes, "options": {"prefault": False}},
                 {"adapter": "nvme", "capacity": f"{cap_mib}MiB",
                  "options": {"path": work.name, "direct_io": False}}]
    else:
        tiers = [{"adapter": "dram", "capacity": f"{cap_mib}MiB", "options": {"prefault": False}}]
    cache = UnifiedCache({"block_tokens": bt, "tiers": tiers, "policy": {"name": "lru"}})
    conn = TransformersConnector(model, cache, block_tokens=bt)
    token_layer_bytes = 2 * kv_heads * head_dim * 4
    try:
        t0 = time.perf_counter()
        dense = [_generate(conn.generate, p, new + 1) for p in prompts]
        conn.wait_stores(120.0)
        cache.flush()  # on the medium: reads from the NVMe tier's write buffer would not count as reads
        log(f"dense: {new + 1} tokens over {args.context}, {samples} prompt(s), in {time.perf_counter() - t0:.0f} s")
        dense_pk: dict[int, dict[str, Any]] = {}
        for L, ts in tasks.items():
            right = 0
            for t in ts:
                x = torch.tensor([t.prompt])
                got, _ = _generate(conn.generate, x, len(t.question) + ANSWER_TOKENS, force=t.question)
                right += t.correct(tok.decode(got[len(t.question):]))
            acc = right / len(ts)
            dense_pk[L] = {"accuracy": acc, "samples": len(ts), "reported": acc >= PASSKEY_MIN_DENSE}
            log(f"dense passkey at {L} tokens: {acc:.2f}")
        conn.wait_stores(120.0)
        every = reselect_every(args)
        configs = [(s, b, e) for e in every for b in budgets_of(args) for s in args.selectors.split(",") if s]
        if not args.no_full_check:
            configs.append((SparseOptions().selector, Budget.ratio(1.0), every[0]))  # the default selector
        rows = []
        for name, budget, each in configs:
            t0 = time.perf_counter()
            medium0 = _medium_bytes(cache)
            dec = SparseDecoder(conn, SparseDecodeConfig(selector=name, budget=budget, sink_tokens=args.sink,
                                                         local_tokens=args.local, page_tokens=args.page_tokens,
                                                         reselect_every=each, rank=args.rank))
            greedy, prefixes = [], []
            for p, (dense_tokens, _) in zip(prompts, dense):
                got, _ = _generate(dec.generate, p, new + 1)
                same = [a == b for a, b in zip(got[1:], dense_tokens[1:])]
                greedy.append(sum(same) / len(same))
                prefixes.append(next((i for i, s in enumerate(same) if not s), len(same)) / len(same))
            stats = dec.stats()  # the greedy runs' counters: bytes per decoded token
            medium = (_medium_bytes(cache) - medium0) / max(1, stats["decode_steps"])
            tf = [_kl_top1(dense_logits[1:], _generate(dec.generate, p, new + 1, force=dense_tokens)[1][1:])
                  for p, (dense_tokens, dense_logits) in zip(prompts, dense)]
            kl, top1 = sum(t[0] for t in tf) / samples, sum(t[1] for t in tf) / samples
            pk: dict[str, Optional[float]] = {}
            for L, ts in tasks.items():
                if not dense_pk[L]["reported"]:
                    pk[str(L)] = None
                    continue
                right = 0
                for t in ts:
                    x = torch.tensor([t.prompt])
                    ans, _ = _generate(dec.generate, x, len(t.question) + ANSWER_TOKENS, force=t.question)
                    right += t.correct(tok.decode(ans[len(t.question):]))
                pk[str(L)] = right / len(ts)
            total = dec.stats()
            row = {"selector": name, "budget": budget_name(budget), "reselect_every": each,
                   "greedy_agreement": round(sum(greedy) / samples, 4),
                   "greedy_prefix": round(sum(prefixes) / samples, 4),
                   "greedy_per_prompt": [round(g, 4) for g in greedy],
                   "tf_kl_mean": round(kl, 5), "tf_kl_per_prompt": [round(t[0], 5) for t in tf],
                   "tf_top1": round(top1, 4), **_bytes(stats, token_layer_bytes),
                   "decode_steps": stats["decode_steps"], "sparse_layer_steps": stats["sparse_layer_steps"],
                   "pages_read": stats.get("pages_copied", 0), "pages_reused": stats["pages_reused"],
                   "dense_fallbacks": total["dense_fallbacks"], "dense_layer_steps": total["dense_layer_steps"],
                   "passkey": pk, "wall_s": round(time.perf_counter() - t0, 1)}
            if work is not None:
                row["nvme_medium_bytes_per_token"] = round(medium, 1)
            rows.append(row)
            log(f"{name:<10} {row['budget']:<14} s={each} greedy {row['greedy_agreement']:.3f} prefix "
                f"{row['greedy_prefix']:.3f} KL {kl:.4f} top1 {top1:.3f} bytes {100 * row['bytes_share']:.1f}% "
                f"passkey {pk} ({row['wall_s']:.0f} s)")
        return {"new_tokens": new, "reselect_every": every, "tiers": [t["adapter"] for t in tiers],
                "samples": samples, "dense_tokens": [d[0] for d in dense],
                "passkey_dense": {str(L): v for L, v in dense_pk.items()}, "passkey_answer_tokens": ANSWER_TOKENS,
                "rows": rows, "connector": conn.stats(), "wall_s": round(time.perf_counter() - t_start, 1)}
    finally:
        conn.close()
        cache.close()
        if work is not None:
            work.cleanup()


def _medium_bytes(cache: Any) -> int:
    """What the NVMe tier's adapter has read from its file so far (0 without one)."""
    return int(cache.stats()["tiers"].get("nvme", {}).get("adapter", {}).get("bytes_read", 0))
