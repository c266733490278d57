"""Engines for prefill/decode disaggregation on this machine: what `ucm bench
pd` and tests/e2e/test_vllm_pd.py start (vllm_servers.py runs them).

`PdCluster` starts, in `mode`:
- "pd": one ucm service (DRAM) and, over it, `prefill` vLLM-CPU OpenAI
  servers with ucm's connector as kv_producer and `decode` ones as
  kv_consumer, and `ucm pd-proxy` in front of them (`url`);
- "pd_cluster": the same across two nodes: the prefill engines on one ucm
  service, the decode engines on another, each service DRAM over one
  Mooncake store pool (a `mooncake_master` on 127.0.0.1, started here);
  the prefill node's Mooncake tier is `write_through`, so its blocks reach
  the pool as they are stored;
- "colocated": `engines` vLLM servers without ucm (their own prefix cache),
  which the caller picks from (round robin in the bench);
- "reference": one vLLM server without ucm.
Every engine serves model `m` with a KV space of `engine_pages` pages and
vLLM's arguments `engine_args` (the prefill engines' followed by
`prefill_args`); with `events`, each engine publishes vLLM's KV events
on an ipc endpoint (its service's catalog on, so ucm's blocks are in
them) and the proxy picks engines by them; with `prefill_order`
"shortest" the prefill engines run vLLM's priority scheduling and the
proxy gives each prefill its prompt's length as priority (`ucm pd-proxy
--prefill-order shortest`); with
`cores`, engine i is bound to cores[i] (`VLLM_CPU_OMP_THREADS_BIND`, in
start order: prefill engines, then decode). Engines log ucm's INFO lines
(the decode connector's per-request P/D line, which `decode_records` reads).
Ports: the proxy 8200 + port_base, engine i 8210 + port_base + i.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ucm.apps.model import page_bytes
from ucm.bench.engines.vllm_servers import Cluster, Servers, counter, get, logging_config, ucm_transfer

MODEL_ID = "pd-bench"  # names the model in the block keys (`ucm_model_id`)
MODES = ("pd", "pd_cluster", "colocated", "reference")
_RECORD = re.compile(r"P/D request (\S+): (\d+) prompt tokens, (\d+) loaded through ucm, (-?\d+) computed here")


class PdCluster(Cluster):
    """See the module docstring. A context manager: `close` stops everything."""

    def __init__(self, work: Path, model_dir: str, *, mode: str = "pd", prefill: int = 1, decode: int = 1,
                 engines: int = 2, dtype: str = "float32", engine_pages: int = 32, dram_blocks: int = 256,
                 block_tokens: int = 128, page_tokens: int = 128, max_model_len: int = 4096, port_base: int = 0,
                 cores: Optional[Sequence[int]] = None, decode_extra: Optional[dict] = None,
                 engine_args: Sequence[str] = (), prefill_args: Sequence[str] = (), events: bool = False,
                 prefill_order: str = "arrival") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} not one of {MODES}")
        self.work, self.model_dir, self.mode = Path(work), model_dir, mode
        self.n_prefill, self.n_decode = (prefill, decode) if mode.startswith("pd") else (0, 0)
        self.n_plain = engines if mode == "colocated" else (1 if mode == "reference" else 0)
        self.dtype, self.engine_pages, self.dram_blocks = dtype, engine_pages, dram_blocks
        self.block_tokens, self.page_tokens, self.max_model_len = block_tokens, page_tokens, max_model_len
        self.port_base, self.cores = port_base, list(cores) if cores is not None else None
        self.decode_extra, self.engine_args = dict(decode_extra or {}), tuple(engine_args)
        self.prefill_args = tuple(prefill_args)  # after engine_args, for the prefill engines only (the last wins)
        self.prefill_order = prefill_order
        if prefill_order == "shortest":
            self.prefill_args += ("--scheduling-policy", "priority")
        self.events = events
        self.endpoints: dict[str, str] = {}  # engine URL -> its KV events endpoint (events=True)
        self.page_bytes = page_bytes(model_dir, dtype, page_tokens)
        self.servers = Servers(self.work)
        self.url = f"http://127.0.0.1:{8200 + port_base}"  # the proxy ("pd")
        self.prefill: list[str] = []
        self.decode: list[str] = []
        self.engines: list[str] = []  # plain engines ("colocated", "reference")
        self.master: Any = None  # the Mooncake master ("pd_cluster")

    def _engine(self, tag: str, index: int, transfer: Optional[dict], args: Sequence[str] = ()) -> str:
        env = {"VLLM_LOGGING_CONFIG_PATH": str(logging_config(self.work))}
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cores[index % len(self.cores)])
        endpoint = f"ipc://{self.work}/{tag}-events.sock"
        if self.events:  # vLLM binds an ipc endpoint; the proxy connects
            args = (*args, "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                             "endpoint": endpoint}))
        url = self.servers.engine(tag, 8210 + self.port_base + index, self.model_dir, dtype=self.dtype,
                                  max_model_len=self.max_model_len, kv_bytes=self.engine_pages * self.page_bytes,
                                  kv_transfer=transfer, args=(*self.engine_args, *args), env=env)
        if self.events:
            self.endpoints[url] = endpoint
        return url

    def _service(self, tag: str, write_through: bool = False) -> Path:
        """Starts a ucm service (DRAM, over the Mooncake pool when there is
        one); its config's path."""
        mib = -(-self.dram_blocks * self.page_bytes * self.block_tokens // self.page_tokens // (1 << 20))
        tiers: list[dict] = [{"adapter": "dram", "capacity": f"{mib}MiB"}]
        if self.master is not None:
            tiers.append({"adapter": "mooncake", "capacity": f"{4 * mib}MiB", "write_through": write_through,
                          "options": {"master": self.master.address, "segment_size": f"{2 * mib}MiB",
                                      "local_buffer_size": "64MiB", "key_prefix": f"pd-{os.getpid()}/"}})
        return self.servers.service(tag, {
            "block_tokens": self.block_tokens, "policy": {"name": "lru"}, "tiers": tiers,
            "events": {"enabled": self.events},
            "service": {"name": f"pd-{os.getpid()}-{self.port_base}-{tag}", "socket": str(self.work / f"{tag}.sock")}})[0]

    def start(self) -> None:
        if self.mode == "pd_cluster":
            from ucm.bench.cache.local_servers import MooncakeMaster

            (self.work / "mooncake").mkdir(parents=True, exist_ok=True)
            self.master = MooncakeMaster(workdir=str(self.work / "mooncake"))
            self.master.start()
        if self.mode.startswith("pd"):
            across = self.mode == "pd_cluster"
            prefill_cfg = self._service("ucm_prefill" if across else "ucm", write_through=across)
            decode_cfg = self._service("ucm_decode") if across else prefill_cfg
            for j in range(self.n_prefill):
                transfer = ucm_transfer("kv_producer", prefill_cfg, MODEL_ID)
                self.prefill.append(self._engine(f"prefill{j + 1}", j, transfer, self.prefill_args))
            for j in range(self.n_decode):
                extra = {f"ucm_{k}": v for k, v in self.decode_extra.items()}
                self.decode.append(self._engine(f"decode{j + 1}", self.n_prefill + j,
                                                ucm_transfer("kv_consumer", decode_cfg, MODEL_ID, **extra)))
        for j in range(self.n_plain):
            self.engines.append(self._engine(f"engine{j + 1}", j, None))
        self.servers.ready(self.prefill + self.decode + self.engines)
        if self.mode.startswith("pd"):
            routing = ["--prefill-events", *(self.endpoints[u] for u in self.prefill),
                       "--decode-events", *(self.endpoints[u] for u in self.decode),
                       "--tokenizer", self.model_dir] if self.events else []
            self.servers.spawn("proxy", [sys.executable, "-m", "ucm.cli", "pd-proxy", "--prefill", *self.prefill,
                                         "--decode", *self.decode, "--port", str(8200 + self.port_base),
                                         "--prefill-order", self.prefill_order, *routing])
            self.servers.wait(lambda: get(self.url, "/health")[0] == 200, 60, "ucm pd-proxy")

    def close(self) -> None:
        self.servers.close()
        if self.master is not None:
            self.master.stop()

    # ---- what the engines did ------------------------------------------------------------
    def counters(self, url: str) -> dict[str, float]:
        """An engine's prompt tokens so far (`prompt`), and those served by
        vLLM's own prefix cache (`engine`) and by the connector (`ucm`)."""
        text = get(url, "/metrics")[1].decode()
        return {"prompt": counter(text, "vllm:prompt_tokens_total"),
                "engine": counter(text, "vllm:prefix_cache_hits_total"),
                "ucm": counter(text, "vllm:external_prefix_cache_hits_total")}

    def decode_records(self) -> dict[str, dict[str, int]]:
        """Per P/D request the decode engines served (by vLLM's request id,
        which contains the X-Request-Id it was sent with): its prompt
        tokens, those loaded through ucm and those computed there, from the
        decode connector's log line."""
        out = {}
        for j in range(self.n_decode):
            log = (self.work / f"decode{j + 1}.log").read_text(errors="replace")
            for rid, prompt, loaded, computed in _RECORD.findall(log):
                out[rid] = {"prompt": int(prompt), "loaded": int(loaded), "computed": int(computed)}
        return out
