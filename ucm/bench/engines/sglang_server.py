"""An SGLang HTTP server as a child process, for `ucm bench sglang` and the
e2e tests: started with `python -m sglang.launch_server` from an SGLang
installation (its own venv here), driven over HTTP on 127.0.0.1 with the
standard library only (nothing of SGLang is imported in this process).

On CPU, SGLang 0.5.23's HiCache needs a shim for its own device<->host
copies (tests/sglang_cpu, test tree only): `SGLangServer(..., pythonpath=
[shim_dir])` puts it first on the server's PYTHONPATH, where its
`sitecustomize` applies it in every SGLang process.

SGLang names its ZMQ IPC sockets with `tempfile.NamedTemporaryFile(delete=
False)` and never removes them: the server runs with TMPDIR set to a
private directory, removed when it stops."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hicache_args(ucm_config: str, layout: str, page_size: int, extra: Optional[dict] = None) -> list[str]:
    """The flags that make ucm SGLang's HiCache storage (README, "SGLang")."""
    cfg = {"backend_name": "ucm", "module_path": "ucm.connectors.sglang", "class_name": "UCMStorage",
           "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "ucm_config": ucm_config, **(extra or {})}
    return ["--page-size", str(page_size), "--enable-hierarchical-cache", "--hicache-mem-layout", layout,
            "--hicache-io-backend", "direct" if layout == "page_first_direct" else "kernel",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(cfg),
            "--hicache-storage-prefetch-policy", "wait_complete", "--hicache-write-policy", "write_through"]


class SGLangServer:
    """One `sglang.launch_server` process on 127.0.0.1."""

    def __init__(self, python: str, model: str, args: Sequence[str] = (), port: Optional[int] = None,
                 pythonpath: Sequence[str] = (), env: Optional[dict] = None, log_path: Optional[str] = None,
                 device: str = "cpu") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--device", device, "--enable-cache-report", "--skip-server-warmup",
               "--log-level", "warning"]
        if device == "cpu":
            cmd += ["--attention-backend", "torch_native", "--disable-cuda-graph"]
        self.cmd = cmd + list(args)
        e = dict(os.environ if env is None else env)
        if pythonpath:
            e["PYTHONPATH"] = os.pathsep.join([*pythonpath, *([e["PYTHONPATH"]] if e.get("PYTHONPATH") else [])])
        e.setdefault("HF_HUB_OFFLINE", "1")
        self.env = e
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.tmp_dir: Optional[str] = None  # the server's TMPDIR (its IPC sockets), while it runs

    def start(self, timeout_s: float = 300.0) -> "SGLangServer":
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.tmp_dir = tempfile.mkdtemp(prefix="ucm-sglang-")
        self.proc = subprocess.Popen(self.cmd, env={**self.env, "TMPDIR": self.tmp_dir}, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode} at start{self._tail()}")
            try:
                if self._get("/model_info", 2.0) is not None:
                    return self
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SGLang server did not answer within {timeout_s:g} s{self._tail()}")

    def _tail(self) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return ":\n" + Path(self.log_path).read_text(errors="replace")[-3000:]

    def _get(self, path: str, timeout_s: float = 30.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read() or b"null")

    def _post(self, path: str, body: Optional[dict], timeout_s: float = 600.0) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            data = r.read()
        try:
            return json.loads(data)
        except ValueError:
            return data.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 1, logprobs: bool = False,
                 extra: Optional[dict] = None) -> dict:
        """Greedy generation from token ids; the reply plus `ttft_s` (the
        request's wall time, which is its TTFT when max_new_tokens=1)."""
        body = {"input_ids": list(input_ids), "return_logprob": logprobs,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}, **(extra or {})}
        t = time.perf_counter()
        out = self._post("/generate", body)
        out["ttft_s"] = time.perf_counter() - t
        return out

    def flush_cache(self, timeout_s: float = 120.0) -> None:
        """Empties SGLang's device and host tiers (POST /flush_cache). SGLang
        refuses (400) while requests or HiCache transfers (a write-through
        backup) are in flight: retried until `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._post("/flush_cache", None)
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 400 or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the server's process group, then removes its TMPDIR."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
