"""The environment of the vLLM engine subprocesses that `make demo`, `ucm
bench vllm` and `ucm bench prefetch` start.

vLLM names its ZMQ IPC sockets under VLLM_RPC_BASE_PATH, by default the
temp dir, and leaves them there (dozens per run): unless the user set it,
they go to the run's work dir, which the run removes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def with_ipc_dir(env: dict[str, str], work: Path) -> dict[str, str]:
    """`env` with VLLM_RPC_BASE_PATH set to `work`/ipc (made) unless set."""
    if "VLLM_RPC_BASE_PATH" not in env:
        (work / "ipc").mkdir(exist_ok=True)
        env["VLLM_RPC_BASE_PATH"] = str(work / "ipc")
    return env


def bench_env(work: Optional[Path] = None) -> dict[str, str]:
    """The benches' engine environment: 1 GiB of CPU KV unless set, the OMP
    threads bound to every core, offline hubs; with `work`, its IPC dir."""
    env = dict(os.environ)
    if work is not None:
        with_ipc_dir(env, work)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env
