"""The vLLM engine subprocesses that `make demo`, `ucm bench vllm` and `ucm
bench prefetch` start: their environment, and (for the benches) how a
run's spec goes in and its result comes out, as JSON files.

vLLM names its ZMQ IPC sockets under VLLM_RPC_BASE_PATH, by default the
temp dir, and leaves them there (dozens per run): unless the user set it,
they go to the run's work dir, which the run removes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


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


def run_spec(module: str, spec: dict[str, Any], work: Path, tag: str, what: str,
             flags: Sequence[str] = (), timeout_s: float = 3600) -> dict[str, Any]:
    """Runs `python -m module [flags] SPEC OUT` in `work` with `bench_env`:
    `spec` goes in as `work/spec-<tag>.json`, the result comes back from
    `work/out-<tag>.json`. A failed run raises RuntimeError naming `what`,
    with the end of its output."""
    spec_path, out_path = work / f"spec-{tag}.json", work / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", module, *flags, str(spec_path), str(out_path)],
                          env=bench_env(work), cwd=str(work), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out_path.read_text())
