"""One run of the demo: one vLLM engine process replaying the workload.

Runs in its own process (`python -m ucm.apps.demo.engine SPEC OUT`, started
by `ucm.apps.demo.run`): vLLM for CPU needs a `__main__` guard, and a run with
ucm after another one must be a new engine, as after a restart. The engine
has vLLM's prefix cache on and a KV space of `kv_bytes` (vLLM's
`kv_cache_memory_bytes`, the byte-exact form of `VLLM_CPU_KVCACHE_SPACE`,
which takes whole GiB); with `ucm_config` it also has UCMConnector.

Requests are sent one at a time, in arrival order (one user's request
after another's, on an engine that is otherwise idle, so that a TTFT is the
request's own). For each it records:
- `ttft_s`: vLLM's first-token latency of the request (arrival to first
  token; a load from ucm below DRAM is inside it);
- `engine_tokens`: prompt tokens served by vLLM's own prefix cache (the
  change of its `vllm:prefix_cache_hits` counter over the request);
- `ucm_tokens`: prompt tokens served by the connector (the change of
  `vllm:external_prefix_cache_hits`), split into `ucm_dram_tokens` and
  `ucm_nvme_tokens` by where the service held those blocks just before the
  request (`locate`; a block still being saved by the previous request
  counts as DRAM, where saves land);
- `tokens`: the greedy output.

Progress goes to the file descriptor in `$UCMDEMO_PROGRESS_FD` when set:
`ready` once the engine is up, then `done <index>` per request.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

BLOCK_TOKENS = 128  # vLLM for CPU's page size, and the demo's ucm block
PROGRESS_FD = "UCMDEMO_PROGRESS_FD"  # not UCM_*: those are config overrides


class _Progress:
    def __init__(self) -> None:
        fd = os.environ.get(PROGRESS_FD)
        self._fd: Optional[int] = int(fd) if fd else None

    def say(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, (line + "\n").encode())
        except OSError:
            self._fd = None  # the driver went away: keep running, stop reporting


def _counters(llm) -> dict[str, float]:
    out = {"engine": 0.0, "ucm": 0.0}
    for m in llm.get_metrics():
        if m.name == "vllm:prefix_cache_hits":
            out["engine"] += float(m.value)
        elif m.name == "vllm:external_prefix_cache_hits":
            out["ucm"] += float(m.value)
    return out


def _engine(spec: dict[str, Any]):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("ucm_config"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"ucm_config": spec["ucm_config"]})
    return LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enforce_eager=True,
               enable_prefix_caching=True, kv_cache_memory_bytes=spec["kv_bytes"], seed=0,
               disable_log_stats=False, **kw)


def replay(spec: dict[str, Any]) -> dict[str, Any]:
    """Starts the engine of `spec` and replays its requests; returns the rows
    (see the module docstring) and the engine's KV capacity."""
    from vllm import SamplingParams

    progress = _Progress()
    t0 = time.perf_counter()
    llm = _engine(spec)
    start_s = time.perf_counter() - t0
    client, ns = None, None
    if spec.get("ucm_config"):
        import ucm
        from ucm.connectors.vllm import build_namespace

        client = ucm.connect(spec["ucm_config"], start=False)  # the demo's service, started by the driver
        ns = build_namespace(llm.llm_engine.vllm_config, BLOCK_TOKENS)
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    # One-time costs of the first forward, paid by a prompt shorter than a block (nothing to cache).
    llm.generate([{"prompt_token_ids": list(range(1000, 1000 + BLOCK_TOKENS - 28))}], sp, use_tqdm=False)
    progress.say("ready")
    rows = []
    for req in spec["requests"]:
        prompt = req["prompt"]
        tiers = _tiers(client, ns, prompt) if client is not None else []
        before = _counters(llm)
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        after = _counters(llm)
        m = getattr(o, "metrics", None)
        ttft = getattr(m, "first_token_latency", None) if m is not None else None
        engine_tokens = int(after["engine"] - before["engine"])
        ucm_tokens = int(after["ucm"] - before["ucm"])
        nvme_tokens = nvme_share(engine_tokens, ucm_tokens, tiers)
        rows.append({
            "index": req["index"], "prompt_tokens": len(prompt), "ttft_s": ttft if ttft else wall, "wall_s": wall,
            "cached_tokens": int(o.num_cached_tokens or 0), "engine_tokens": engine_tokens,
            "ucm_tokens": ucm_tokens, "ucm_dram_tokens": ucm_tokens - nvme_tokens, "ucm_nvme_tokens": nvme_tokens,
            "tokens": [int(x) for x in o.outputs[0].token_ids],
        })
        progress.say(f"done {req['index']}")
    kv_pages = None
    try:
        kv_pages = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    except (AttributeError, TypeError, ValueError):
        pass
    if client is not None:
        client.close()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return {"rows": rows, "engine_start_s": start_s, "engine_kv_pages": kv_pages}


def nvme_share(engine_tokens: int, ucm_tokens: int, tiers: list[Optional[str]]) -> int:
    """Of the `ucm_tokens` the connector served after vLLM's own
    `engine_tokens`, those in blocks held below DRAM (`tiers`: per block,
    from `_tiers`), counted per token: a hit's last block is often partial
    (vLLM computes the prompt's last token at least), so it counts only
    the tokens it served."""
    end = engine_tokens + ucm_tokens
    out = 0
    for b in range(engine_tokens // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)):
        t = tiers[b] if b < len(tiers) else None
        if t is not None and t != "dram":
            out += min((b + 1) * BLOCK_TOKENS, end) - max(b * BLOCK_TOKENS, engine_tokens)
    return out


def _tiers(client, ns, prompt: list[int]) -> list[Optional[str]]:
    """Where the service holds each full block of `prompt` now (None: not
    cached, or a save still in flight)."""
    from ucm.keys import block_keys

    keys = block_keys(ns, prompt, BLOCK_TOKENS)
    if not keys:
        return []
    try:
        return list(client.locate(keys))
    except Exception:  # the service is down: nothing is served from it either
        return [None] * len(keys)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m ucm.apps.demo.engine SPEC.json OUT.json (started by ucm.apps.demo.run)", file=sys.stderr)
        sys.exit(2)
    result = replay(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
