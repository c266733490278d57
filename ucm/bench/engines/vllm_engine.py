"""One vLLM engine of `ucm bench vllm` (and its codec runs), driven in the
configuration's own subprocess: the engine built with or without a KV
connector, prompts asked one at a time and timed, rounds of them, and the
namespace UCMConnector gives the engine's blocks (to name their ucm keys).

Everything here runs in the configuration's subprocess, in its main
thread; `generate` blocks until the request's tokens are out.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

BLOCK_TOKENS = 128  # the ucm block of every vLLM bench: 128 tokens


def make_engine(model: str, max_len: int, prefix_caching: bool, kv: Optional[dict]) -> Any:
    """An `LLM` (eager, seed 0) with vLLM's prefix caching on or off and the
    KV connector `kv` (`KVTransferConfig` fields; None: no connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if kv is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**kv)
    return LLM(model=model, max_model_len=max_len, enforce_eager=True, enable_prefix_caching=prefix_caching,
               seed=0, **kw)


def timed(llm: Any, prompts: list[list[int]], max_tokens: int = 1) -> tuple[list[float], list[list[int]], list[int]]:
    """Each prompt asked alone, greedy: the seconds of its `generate` call
    (its time to first token when `max_tokens` is 1), its tokens and the
    tokens vLLM reports cached."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ttft, toks, cached = [], [], []
    for p in prompts:
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t0)
        toks.append(list(o.outputs[0].token_ids))
        cached.append(int(o.num_cached_tokens or 0))
    return ttft, toks, cached


def phase(llm: Any, prompts: list[list[int]], max_tokens: int = 1) -> dict[str, Any]:
    """`timed` as a dict: `ttft_s`, `tokens`, `cached`."""
    ttft, toks, cached = timed(llm, prompts, max_tokens)
    return {"ttft_s": ttft, "tokens": toks, "cached": cached}


def rounds(llm: Any, prompts: list[list[int]], n: int, before: Optional[Callable[[], None]] = None,
           one: Callable[..., dict[str, Any]] = phase) -> dict[str, Any]:
    """`n` phases of the same prompts (`before()` ahead of each; `one` runs
    a phase): every TTFT, round after round; the tokens and cached counts
    of every round."""
    phases = []
    for _ in range(n):
        if before is not None:
            before()
        phases.append(one(llm, prompts))
    return {"ttft_s": [t for ph in phases for t in ph["ttft_s"]],
            "tokens": [tok for ph in phases for tok in ph["tokens"]],
            "cached": [c for ph in phases for c in ph["cached"]]}


def namespace(vllm_config: Any) -> Any:
    """The namespace UCMConnector gives the blocks of the engine of
    `vllm_config` (model fingerprint, KV dtype, geometry, pages)."""
    from ucm.connectors.vllm import build_namespace

    return build_namespace(vllm_config, BLOCK_TOKENS)


def shutdown(llm: Any) -> None:
    """Stops the engine core now, not at interpreter exit (best effort)."""
    try:
        llm.llm_engine.engine_core.shutdown()  # no public shutdown on LLM: its engine core's
    except Exception:
        pass
