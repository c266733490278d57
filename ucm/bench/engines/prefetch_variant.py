"""One variant of `ucm bench prefetch` in one vLLM engine, run in its own
subprocess by the bench (ucm/bench/engines/prefetch_bench.py, which documents the
variants and what is measured):

    python -m ucm.bench.engines.prefetch_variant SPEC.json OUT.json

SPEC names the variant, its prompts, arrival offsets per pattern, the
service's YAML and what to do before each pattern (push the documents to
NVMe, or reset vLLM's prefix cache); OUT gets per pattern every request's
TTFT, tokens and cached length, the service's counters moved by it, and
the connector's per-request I/O times (ucm.bench.engines.prefetch_probe).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ucm.bench.blocks import push_below_dram, tier_counts
from ucm.bench.engines.prefetch_bench import GEN_TOKENS, POLICY, STREAMING
from ucm.bench.engines.vllm_engine import BLOCK_TOKENS, namespace


async def _generate(engine, prompt: list[int], rid: str, arrival_at: float, t0: float) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
    await asyncio.sleep(max(0.0, arrival_at - time.perf_counter()))
    arrived = time.perf_counter()
    first: Optional[float] = None
    toks: list[int] = []
    cached = 0
    async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=rid):
        if first is None and out.outputs and out.outputs[0].token_ids:
            first = time.perf_counter()
        toks = list(out.outputs[0].token_ids)  # cumulative outputs
        cached = int(out.num_cached_tokens or 0)
    done = time.perf_counter()
    return {"ttft_s": round((first or done) - arrived, 4), "arrival_s": round(arrived - t0, 4),
            "done_s": round(done - t0, 4), "tokens": toks, "cached": cached}


async def _pattern(engine, prompts: list[list[int]], offsets: list[float], tag: str) -> list[dict]:
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(_generate(engine, p, f"{tag}-{i}", t0 + off, t0)
                                       for i, (p, off) in enumerate(zip(prompts, offsets)))))


def _probe(path: Path, tag: str) -> dict[int, dict]:
    """The connector's per-request I/O times for the requests of `tag`
    (vLLM may add a suffix to a request id)."""
    out: dict[int, dict] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rid = r["request_id"]
        if rid.startswith(tag + "-"):
            out[int(rid[len(tag) + 1:].split("-")[0])] = r
    return out


def _stats_delta(s0: dict, s1: dict) -> dict[str, Any]:
    nv0, nv1 = s0["tiers"].get("nvme", {}), s1["tiers"].get("nvme", {})
    dr0, dr1 = s0["tiers"]["dram"], s1["tiers"]["dram"]
    read = nv1.get("adapter", {}).get("bytes_read", 0) - nv0.get("adapter", {}).get("bytes_read", 0)
    return {"nvme_bytes_read": read,
            "dram_promotions_in": dr1.get("promotions_in", 0) - dr0.get("promotions_in", 0),
            "bytes_loaded": s1.get("bytes_loaded", 0) - s0.get("bytes_loaded", 0),
            "missing_blocks": s1.get("missing_blocks", 0) - s0.get("missing_blocks", 0),
            "accelerator": {k: round(v - (s0.get("accelerators") or {}).get("prefetch", {}).get(k, 0), 6)
                            for k, v in ((s1.get("accelerators") or {}).get("prefetch") or {}).items()}}


async def _run_variant_async(spec: dict) -> dict:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    name, prompts = spec["variant"], spec["prompts"]
    probe = Path(spec["work"]) / f"probe-{name}.jsonl"
    kw: dict[str, Any] = {}
    if name != "no_ucm":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UCMConnector", kv_connector_module_path="ucm.bench.engines.prefetch_probe", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"ucm_config": spec["ucm_config"], "ucm_prefetch_policy": POLICY[name],
                                       "ucm_load_streaming": STREAMING.get(name, "off"),
                                       "bench_probe_path": str(probe)})
    args = AsyncEngineArgs(model=spec["model"], max_model_len=max(len(p) for p in prompts) + 2 * GEN_TOKENS,
                           dtype=spec["dtype"], enforce_eager=True, enable_prefix_caching=(name == "no_ucm"), seed=0,
                           max_num_seqs=spec["max_num_seqs"], **kw)
    engine = AsyncLLM.from_engine_args(args)
    out: dict[str, Any] = {"patterns": {}}
    client = None
    try:
        await _pattern(engine, [spec["warm"]], [0.0], "warm")
        keys: list[bytes] = []
        if name != "no_ucm":
            import ucm
            from ucm.keys import block_keys

            client = ucm.connect(spec["ucm_config"], start=False)
            ns = namespace(engine.vllm_config)
            doc_keys = [block_keys(ns, p, BLOCK_TOKENS) for p in prompts]
            keys = [k for ks in doc_keys for k in ks]
            out["doc_keys"] = [[k.hex() for k in ks] for ks in doc_keys]
            if spec.get("store_pass"):
                cold = await _pattern(engine, prompts, [0.0] * len(prompts), "store")
                out["store_pass"] = cold
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not all(client.lookup(ks) == len(ks) for ks in doc_keys):
                    await asyncio.sleep(0.5)  # the last saves still in flight
                client.flush()
                out["stored_tiers"] = tier_counts(client.locate(keys))
        for pattern in spec["patterns"]:
            if name == "no_ucm":
                await engine.reset_prefix_cache()
            elif spec["push_to_nvme"]:
                out.setdefault("tiers_before", {})[pattern] = tier_counts(
                    push_below_dram(client, keys, spec["block_bytes"], limit=400))
            else:
                out.setdefault("tiers_before", {})[pattern] = tier_counts(client.locate(keys))
            s0 = client.stats() if client else None
            res = await _pattern(engine, prompts, spec["arrivals"][pattern], pattern)
            rec: dict[str, Any] = {"requests": res}
            if client is not None:
                await asyncio.sleep(0.5)  # the last requests' probe lines
                rec["service"] = _stats_delta(s0, client.stats())
                rec["probe"] = _probe(probe, pattern)
            out["patterns"][pattern] = rec
        if name == "no_ucm":  # the full-hit reference: each prompt again, hitting vLLM's own prefix cache
            refs = []
            full = [(len(p) - 1) // BLOCK_TOKENS * BLOCK_TOKENS for p in prompts]
            for i, p in enumerate(prompts):
                r = (await _pattern(engine, [p], [0.0], f"ref{i}"))[0]
                if r["cached"] < full[i]:  # evicted from vLLM's cache meanwhile: computed now, hit next
                    r = (await _pattern(engine, [p], [0.0], f"ref{i}b"))[0]
                refs.append(r)
            out["apc_reference"] = refs
    finally:
        if client is not None:
            client.close()
        engine.shutdown()
    return out


def _run_variant(spec: dict) -> dict:
    return asyncio.run(_run_variant_async(spec))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m ucm.bench.engines.prefetch_variant SPEC.json OUT.json")
    Path(sys.argv[2]).write_text(json.dumps(_run_variant(json.loads(Path(sys.argv[1]).read_text()))))
