"""Chaos driver for tests/e2e/test_chaos.py (issue 14): vLLM for CPU serves
a seeded stream of requests with hits while the ucm service (and, in the
cluster variants, redis-server and mooncake_master) is SIGKILLed and
restarted at random instants; every output must equal vLLM's own output on
the same cached prefix, and every block ucm delivers must be bytes vLLM
computed for that key.

Run as a script (vLLM needs the `__main__` guard):

    python tests/e2e/chaos_vllm.py --variant nvme --out result.json [--kills 4]

Processes: this driver; a standalone `ucm serve` (and the cluster servers)
it starts, kills and restarts from a killer thread; one vLLM engine whose
engine-core and worker processes load `RecordingConnector` from this file
(UCMConnector unchanged, plus a record of what moved); after the chaos run,
a reference engine without a connector (vLLM prefix caching on).

Why a record, not just a reference per cached-token count: the KV of
a block depends on how it was computed (the forward that wrote it started at
token 0 or on top of a cached prefix, and how many tokens that forward had),
not only on its tokens. A block that a request recomputed after a kill, on
top of a partial hit, is other bytes than the cold prefill of the same
tokens, and a later hit on it gives other greedy tokens than a hit on cold
KV. So the worker side records, per step, a digest of every block it loads
(after the copy) and saves (the pages the forward wrote), and which pages
failed to load. From that the driver knows, for each request, the exact
bytes of its delivered prefix and which earlier forward produced each block
(the provenance), and rebuilds that prefix in the reference engine forward
by forward: `reset_prefix_cache()`, then for each forward of the chain a
prompt made of the shared tokens followed by filler tokens up to that
forward's length (a block's KV depends on the tokens before it, the forward's
start and its length, not on the values of the tokens after it; checked
while writing this driver), then the request itself, whose
`num_cached_tokens` must equal the delivered prefix. Its greedy tokens must
equal the chaos run's.

Counted: wrong blocks (a delivered digest that vLLM never computed for that
key), tainted deliveries (a block saved in the step whose synchronous load
failed, so computed over pages that did not load), wrong outputs, requests
whose prefix mixes block versions no single history of forwards produces
(reported, bytes still checked), engine exceptions, kills.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ucm.connectors.vllm import UCMConnector
from ucm.connectors.vllm.metadata import UCMConnectorMetadata
from vllm_support import E2E_DTYPE, close_engine, driver_env, scaled_mib  # noqa: E402

BLOCK_TOKENS = 256
MAX_TOKENS = 8
MAX_MODEL_LEN = 2048
RECORD_ENV = "UCMCHAOS_RECORD"  # the record file, set by the driver for the engine processes
VARIANTS = ("nvme", "redis", "mooncake", "cluster")


# ---- the recording connector (engine-core and worker processes) -------------
class RecordingConnector(UCMConnector):
    """UCMConnector with a record of its worker's data moves, one JSON line
    per event in $UCMCHAOS_RECORD: `load` (request, block keys, their pages,
    a digest of each block's bytes once loaded), `save` (the same for the
    blocks a step saves, digested before the save copies them), `errors`
    (pages reported as failed to load), each with the worker's step number.
    Runs in the worker's main thread only; the scheduler side is untouched."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self._rec_layers = [kv_caches[n] for n in names]
        self._rec_async: dict[str, list] = {}
        self._rec_step = 0
        self._rec_file = open(os.environ[RECORD_ENV], "a", buffering=1)
        t = self._rec_layers[0]
        self._rec({"ev": "register", "layers": len(names), "shape": list(t.shape), "dtype": str(t.dtype)})

    def _rec(self, ev: dict) -> None:
        ev["step"] = self._rec_step
        self._rec_file.write(json.dumps(ev) + "\n")

    def _digests(self, page_ids: list[list[int]]) -> list[str]:
        out = []
        for pages in page_ids:
            h = hashlib.blake2b(digest_size=16)
            for t in self._rec_layers:  # a layer's view is [pages, heads, page tokens, K|V]
                for p in pages:
                    h.update(t[p].contiguous().view(torch.uint8).numpy())
            out.append(h.hexdigest())
        return out

    def _job(self, kind: str, job: Any) -> None:
        self._rec({"ev": kind, "req": job.req_id, "keys": [k.hex() for k in job.keys], "pages": job.page_ids,
                   "digests": self._digests(job.page_ids), "async": bool(getattr(job, "is_async", False))})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = getattr(self, "_connector_metadata", None)
        super().start_load_kv(forward_context, **kwargs)
        if not isinstance(meta, UCMConnectorMetadata) or not hasattr(self, "_rec_file"):
            return
        self._rec_streamed = []
        for job in meta.loads:
            if job.is_async:  # digested once get_finished reports it loaded
                self._rec_async.setdefault(job.req_id, []).append(job)
            elif getattr(job, "stream", False):  # filled layer by layer during the forward: digested after it
                self._rec_streamed.append(job)
            else:
                self._job("load", job)

    def wait_for_save(self) -> None:
        meta = getattr(self, "_connector_metadata", None)
        if isinstance(meta, UCMConnectorMetadata) and hasattr(self, "_rec_file"):
            for job in meta.stores:  # the forward has written these pages; the save copies them later
                self._job("save", job)
        super().wait_for_save()  # ends this step's streamed loads
        for job in getattr(self, "_rec_streamed", ()):
            self._job("load", job)
        self._rec_streamed = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        sending, recving = super().get_finished(finished_req_ids)
        if hasattr(self, "_rec_file"):
            for r in recving or ():
                for job in self._rec_async.pop(r, []):
                    self._job("load", job)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad = super().get_block_ids_with_load_errors()
        if hasattr(self, "_rec_file"):
            if bad:
                self._rec({"ev": "errors", "pages": sorted(bad)})
            self._rec_step += 1  # the last connector call of a step
        return bad


# ---- the driver -----------------------------------------------------------------
def _stream(seed: int, n_docs: int, vocab: int = 40000):
    """`n_docs` documents of 700-1500 random token ids asked again and again
    in shuffled rounds, each time followed by another short question (random
    ids too); after every second request a one-shot document, never asked
    again, that pushes older blocks down to the lower tier and through it
    (an LRU over a cyclic stream larger than the cache would hit nothing).
    Yields (document index, prompt); one-shot documents have index -1."""
    rng = random.Random(seed)

    def doc() -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(rng.randrange(700, 1501))]

    docs = [doc() for _ in range(n_docs)]

    def gen():
        n = 0
        while True:
            order = list(range(n_docs))
            rng.shuffle(order)
            for d in order:
                q = [rng.randrange(1000, vocab) for _ in range(rng.randrange(6, 24))]
                yield d, docs[d] + q
                n += 1
                if n % 2 == 0:
                    yield -1, doc() + [rng.randrange(1000, vocab) for _ in range(rng.randrange(6, 24))]
    return docs, gen()


def _service_config(variant: str, work: Path, urls: dict) -> dict:
    dram = {"adapter": "dram", "capacity": scaled_mib(48), "options": {"path": "/dev/shm", "prefault": False}}
    tiers: list[dict] = [dram]
    if variant == "nvme":
        # Two blocks per region (5.6 MiB in bfloat16, 11.25 MiB in float32:
        # capacities are sized in bfloat16 and scaled), about 30 blocks in all; the
        # documents asked again fit, the one-shot ones push blocks through:
        # regions seal and are reclaimed.
        (work / "nvme").mkdir(exist_ok=True)
        tiers.append({"adapter": "nvme", "capacity": scaled_mib(192),
                      "options": {"path": str(work / "nvme"), "region_size": scaled_mib(12), "direct_io": False}})
    if variant in ("mooncake", "cluster"):
        tiers.append({"adapter": "mooncake", "capacity": scaled_mib(96),
                      "options": {"master": urls["mooncake"], "segment_size": scaled_mib(128),
                                  "local_buffer_size": scaled_mib(16), "key_prefix": "chaos/"}})
    if variant in ("redis", "cluster"):
        tiers.append({"adapter": "redis", "capacity": scaled_mib(256),
                      "options": {"url": urls["redis"], "key_prefix": "chaos/"}})
    return {"block_tokens": BLOCK_TOKENS, "tiers": tiers, "policy": {"name": "lru"},
            "service": {"name": f"chaos-{variant}", "socket": str(work / "ucm.sock"), "metrics_port": None}}


class Service:
    """The standalone `ucm serve` under test: start, SIGKILL, restart."""

    def __init__(self, cfg_path: Path, work: Path) -> None:
        from ucm.service.client.cache_client import CacheClient

        self.cfg_path, self.work = cfg_path, work
        self.proc: Optional[subprocess.Popen] = None
        self.client = CacheClient(str(work / "ucm.sock"))
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> int:
        log = open(self.work / "serve.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", str(self.cfg_path)],
                                     cwd=str(self.work), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ucm serve exited with {self.proc.returncode}; see {self.work / 'serve.log'}")
            st = self.client.stats()
            if st and st.get("service", {}).get("pid") == self.proc.pid:
                return self.proc.pid
            time.sleep(0.1)
        raise RuntimeError("ucm serve did not answer")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.client.close()


def _summary(st: dict) -> Optional[dict]:
    """What the service did in this lifetime (its counters restart with it)."""
    if not st or "tiers" not in st:
        return None
    out: dict = {k: st.get(k, 0) for k in ("lookups", "stored_blocks", "loaded_blocks", "missing_blocks",
                                             "corrupt", "failed", "store_refused", "headroom_evictions")}
    out["pid"] = st.get("service", {}).get("pid")
    tiers = {}
    for name, t in st["tiers"].items():
        a = t.get("adapter", {}) or {}
        row = {k: t.get(k, 0) for k in ("blocks", "inserts", "hits", "evictions", "demotions_in", "promotions_in")}
        for k in ("regions_sealed", "regions_reclaimed", "reinserted", "dropped", "recovered_blocks", "corrupt",
                  "read_errors", "write_errors"):
            if k in a:
                row[k] = a[k]
        tiers[name] = row
    out["tiers"] = tiers
    return out


class Killer(threading.Thread):
    """SIGKILLs one target `kills` times, at seeded random instants spread
    over the stream: a random delay (0-1.5 s) into a request drawn among the
    first `span` ones, so kills fall into lookups, loads, forwards and the
    saves behind them; each time it waits 0.2-1.5 s and restarts the target.
    Before each kill it records the ucm service's stats (when it answers)
    and which request was in flight. No fixed sleep decides whether a kill
    lands during the stream: it waits for its request to start."""

    def __init__(self, rng: random.Random, kills: int, span: int, targets: dict, service: Service,
                 current: list) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.rng, self.kills, self.targets, self.service, self.current = rng, kills, targets, service, current
        self.at = sorted(rng.sample(range(1, max(span, kills + 1)), kills))
        self.stop_event = threading.Event()
        self.log: list[dict] = []
        self.error: Optional[str] = None

    def _wait_for(self, i: int) -> bool:
        while not self.stop_event.is_set():
            cur = self.current[0]
            if cur is not None and cur >= i:
                return True
            self.stop_event.wait(0.02)
        return False

    def run(self) -> None:
        names = sorted(self.targets)
        order: list[str] = []
        try:
            for n, i in enumerate(self.at):
                if not order:  # every target once per round, in a seeded order
                    order = names[:]
                    self.rng.shuffle(order)
                name = order.pop()
                if not self._wait_for(i) or self.stop_event.wait(self.rng.uniform(0.0, 1.5)):
                    return
                kill, start = self.targets[name]
                ev = {"n": n + 1, "target": name, "request": self.current[0],
                      "stats_before": _summary(self.service.client.stats()) if name == "ucm" else None}
                t0 = time.monotonic()
                kill()
                time.sleep(self.rng.uniform(0.2, 1.5))
                start()
                ev["down_s"] = round(time.monotonic() - t0, 2)
                ev["request_after"] = self.current[0]
                self.log.append(ev)
        except Exception as e:  # reported; the test fails on it
            self.error = repr(e)


def _engine(model: str, cfg_path: Optional[Path], streaming: str = "auto"):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict = {}
    if cfg_path is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="RecordingConnector", kv_connector_module_path="chaos_vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            # Hits below DRAM streamed layer by layer: the service dies under streamed loads too.
            kv_connector_extra_config={"ucm_config": str(cfg_path), "ucm_load_streaming": streaming})
    # One forward per prefill (max_num_batched_tokens >= any prompt): a
    # block's bytes depend on the forward that computed it.
    return LLM(model=model, dtype=E2E_DTYPE, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=4096,
               enforce_eager=True, enable_prefix_caching=cfg_path is None, seed=0, **kw)


def _generate(llm, prompt: list[int], max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def _start_cluster(variant: str, work: Path) -> tuple[dict, dict, list]:
    """redis-server / mooncake_master on 127.0.0.1, as the variant needs:
    their addresses, their kill/restart pairs, the servers."""
    from ucm.bench.cache.cluster_io import MooncakeMaster, RedisServer

    urls, targets, servers = {}, {}, []
    if variant in ("redis", "cluster"):
        r = RedisServer(workdir=str(work))
        r.start()
        servers.append(r)
        urls["redis"] = r.url
        targets["redis"] = (r.kill, r.start)
    if variant in ("mooncake", "cluster"):
        m = MooncakeMaster(workdir=str(work))
        m.start()
        servers.append(m)
        urls["mooncake"] = m.address
        targets["mooncake_master"] = (m.kill, m.start)
    return urls, targets, servers


def chaos(variant: str, work: Path, kills: int, min_requests: int, seed: int, n_docs: int) -> dict:
    import yaml

    from ucm.keys import Namespace, block_keys
    from ucm.apps.model import prepare

    model = str(prepare("smollm2"))
    record = work / "record.jsonl"
    record.write_text("")
    os.environ[RECORD_ENV] = str(record)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent),
                                                os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    urls, targets, servers = _start_cluster(variant, work)
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(_service_config(variant, work, urls)))
    service = Service(cfg_path, work)
    result: dict = {"variant": variant, "seed": seed, "kills_planned": kills}
    t_start = time.monotonic()
    docs, stream = _stream(seed, n_docs)
    from vllm.config import ModelConfig

    from ucm.connectors.vllm.namespace import model_identity

    # The keys UCMConnector gives these prompts' blocks (checked against the record).
    ns = Namespace(model=model_identity(ModelConfig(model=model, dtype=E2E_DTYPE, skip_tokenizer_init=True)),
                   kv_dtype=E2E_DTYPE, num_layers=30, num_kv_heads=3, head_size=64, block_tokens=BLOCK_TOKENS, layout="vllm-cpu-page128")
    requests: list[dict] = []
    killer: Optional[Killer] = None
    try:
        service.start()
        targets["ucm"] = (service.kill, service.start)
        llm = _engine(model, cfg_path)
        result["engine_start_s"] = round(time.monotonic() - t_start, 1)
        current = [None]
        killer = Killer(random.Random(seed + 1), kills, min_requests - 2, targets, service, current)
        killer.start()
        max_requests = 4 * min_requests
        t_run = time.monotonic()
        while len(requests) < max_requests and (len(requests) < min_requests or killer.is_alive()):
            d, prompt = next(stream)
            i = len(requests)
            current[0] = i
            row: dict = {"i": i, "doc": d, "prompt": prompt, "keys": [k.hex() for k in block_keys(ns, prompt)]}
            # what the service holds of this prompt just before (the killer may change it meanwhile)
            row["avail"] = service.client.lookup([bytes.fromhex(k) for k in row["keys"]])
            t0 = time.monotonic()
            try:
                o = _generate(llm, prompt)
                row.update(request_id=o.request_id, cached=int(o.num_cached_tokens or 0),
                           tokens=list(o.outputs[0].token_ids))
            except Exception as e:  # counted: the engine must never see a cache fault
                row["exception"] = repr(e)
            row["s"] = round(time.monotonic() - t0, 2)
            requests.append(row)
        current[0] = None
        result["chaos_run_s"] = round(time.monotonic() - t_run, 1)
        killer.stop_event.set()
        killer.join(120)
        for name, (_, start) in targets.items():  # everything up again for the final stats
            if name != "ucm":
                start()
        if service.proc is None or service.proc.poll() is not None:
            service.start()
        time.sleep(1.0)
        result["final_stats"] = _summary(service.client.stats())
        close_engine(llm)
    finally:
        if killer is not None:
            killer.stop_event.set()
        service.stop()
        for s in reversed(servers):
            s.stop()
    result["kills"] = killer.log if killer else []
    result["killer_error"] = killer.error if killer else "not started"
    result["service_starts"] = service.starts
    serve_log = (work / "serve.log").read_text(errors="replace")
    result["serve_log_tracebacks"] = serve_log.count("Traceback")
    events = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    result["record_events"] = len(events)
    analysis = provenance(requests, events)
    result["wall_chaos_s"] = round(time.monotonic() - t_start, 1)
    t_ref = time.monotonic()
    reference(model, requests, analysis, seed)
    result["reference_s"] = round(time.monotonic() - t_ref, 1)
    result["requests"] = [{k: v for k, v in r.items() if k not in ("prompt", "keys")} | {"len": len(r["prompt"])}
                          for r in requests]
    result.update(analysis["totals"])
    result.update(_totals(requests, result))
    return result


# ---- provenance: which forward produced each delivered block ----------------------
class _NoPlan(Exception):
    pass


def provenance(requests: list[dict], events: list[dict]) -> dict:
    """Per request: `delivered` (block index -> digest of the bytes that
    loaded), `start` (tokens of the prefix the final forward ran on), the
    forward chain that rebuilds that prefix (`plan`), or why none
    (`status`). Totals: wrong blocks, tainted deliveries."""
    by_ext = {r["request_id"]: r for r in requests if "request_id" in r}
    pos_of: dict[int, dict[str, int]] = {r["i"]: {k: j for j, k in enumerate(r["keys"])} for r in requests}
    errors_by_step: dict[int, set[int]] = {}
    for ev in events:
        if ev["ev"] == "errors":
            errors_by_step.setdefault(ev["step"], set()).update(ev["pages"])
    unknown_keys = 0
    for r in requests:
        r["delivered"], r["start_blocks"], r["computed"], r["tainted_saves"] = {}, 0, {}, set()
        r["loads"], r["load_errors"] = 0, 0
    sync_failed: set[tuple[str, int]] = set()  # (request, step) of a sync load with errors
    for ev in events:
        if ev["ev"] not in ("load", "save"):
            continue
        r = by_ext.get(ev["req"].rsplit("-", 1)[0])
        if r is None:
            continue
        pos = pos_of[r["i"]]
        idx = [pos.get(k) for k in ev["keys"]]
        if None in idx:
            unknown_keys += 1
            continue
        if ev["ev"] == "load":
            r["loads"] += 1
            bad = errors_by_step.get(ev["step"], set())
            ok = 0
            while ok < len(idx) and not any(p in bad for p in ev["pages"][ok] if p >= 0):
                ok += 1
            if ok < len(idx):
                r["load_errors"] += 1
                if not ev["async"]:
                    sync_failed.add((ev["req"], ev["step"]))
            for j, dg in zip(idx[:ok], ev["digests"][:ok]):
                r["delivered"][j] = dg
            # vLLM truncates the computed prefix at the first block that failed
            r["start_blocks"] = idx[0] + ok if ok < len(idx) else max(r["start_blocks"], idx[-1] + 1)
        else:
            tainted = (ev["req"], ev["step"]) in sync_failed
            for j, dg in zip(idx, ev["digests"]):
                if tainted:
                    r["tainted_saves"].add((j, dg))
                else:
                    r["computed"].setdefault(j, dg)
    # sources: (key, digest) -> requests whose final forward computed those bytes / tainted saves
    sources: dict[tuple[str, str], list[dict]] = {}
    tainted_src: dict[tuple[str, str], list[dict]] = {}
    for r in requests:
        for j, dg in r["computed"].items():
            sources.setdefault((r["keys"][j], dg), []).append(r)
        for j, dg in r["tainted_saves"]:
            tainted_src.setdefault((r["keys"][j], dg), []).append(r)
    wrong_blocks, tainted_deliveries = [], []
    for r in requests:
        for j in range(r["start_blocks"]):
            dg = r["delivered"].get(j)
            key = (r["keys"][j], dg)
            if dg is None:
                r.setdefault("status", f"block {j} of the prefix has no load record")
            elif key not in sources and key not in tainted_src:
                wrong_blocks.append({"request": r["i"], "block": j})
            elif key not in sources:
                tainted_deliveries.append({"request": r["i"], "block": j,
                                           "saved_by": [s["i"] for s in tainted_src[key]]})

    def plan(r: dict, n: int, depth: int = 0) -> list[tuple[int, int, int]]:
        """Forwards (start tokens, shared tokens, forward length) that rebuild
        r's delivered blocks [0, n) in vLLM's prefix cache."""
        if n == 0:
            return []
        if depth > 16:
            raise _NoPlan("chain too deep")
        j = n - 1
        for c in sources.get((r["keys"][j], r["delivered"].get(j)), []):
            a = c["start_blocks"]
            if a > j or c["i"] >= r["i"] and c is not r:
                continue
            if all(c["computed"].get(b) == r["delivered"].get(b) for b in range(a, n)) and \
                    all(c["delivered"].get(b) == r["delivered"].get(b) for b in range(a)):
                return plan(c, a, depth + 1) + [(a * BLOCK_TOKENS, n * BLOCK_TOKENS, len(c["prompt"]))]
        raise _NoPlan(f"block {j}: no earlier forward computed these bytes over the same prefix")

    mixed = 0
    for r in requests:
        if "tokens" not in r or "status" in r:
            continue
        try:
            r["plan"] = plan(r, r["start_blocks"])
        except _NoPlan as e:
            r["status"] = f"unreproducible: {e}"
            mixed += 1
    totals = {"wrong_blocks": len(wrong_blocks), "wrong_block_list": wrong_blocks[:20],
              "tainted_deliveries": len(tainted_deliveries), "tainted_list": tainted_deliveries[:20],
              "unreproducible": mixed, "unknown_keys": unknown_keys,
              "delivered_blocks": sum(len(r["delivered"]) for r in requests),
              "sync_loads_failed": len(sync_failed),
              "requests_with_load_errors": sum(1 for r in requests if r["load_errors"])}
    for r in requests:
        r["start"] = r["start_blocks"] * BLOCK_TOKENS
        for k in ("delivered", "computed", "tainted_saves", "start_blocks"):
            r.pop(k, None)
    return {"totals": totals}


def reference(model: str, requests: list[dict], analysis: dict, seed: int) -> None:
    """Rebuilds each request's prefix in a reference engine (no connector,
    prefix caching on) and runs the request on it: `ref_tokens`,
    `ref_cached` (must equal `start`), `match`."""
    llm = _engine(model, None)
    rng = random.Random(seed + 2)
    filler_vocab = (40000, 49000)  # the stream uses ids below 40000: filler never matches its pages
    done: dict[tuple, tuple[list[int], int, bool]] = {}
    try:
        for r in requests:
            if "plan" not in r:
                continue
            key = (tuple(r["plan"]), tuple(r["prompt"]))
            if key not in done:
                if not llm.reset_prefix_cache():
                    raise RuntimeError("reset_prefix_cache refused")
                steps_ok = True
                for start, shared, length in r["plan"]:
                    p = r["prompt"][:shared] + [rng.randrange(*filler_vocab) for _ in range(length - shared)]
                    o = _generate(llm, p, max_tokens=1)
                    steps_ok = steps_ok and int(o.num_cached_tokens or 0) == start
                o = _generate(llm, r["prompt"])
                done[key] = (list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), steps_ok)
            r["ref_tokens"], r["ref_cached"], r["ref_steps_ok"] = done[key]
            r["match"] = r["ref_tokens"] == r["tokens"]
    finally:
        close_engine(llm)


def _totals(requests: list[dict], result: dict) -> dict:
    compared = [r for r in requests if "match" in r]
    hits = [r for r in requests if r.get("cached", 0) > 0]
    return {
        "requests_served": sum(1 for r in requests if "tokens" in r),
        "exceptions": sum(1 for r in requests if "exception" in r),
        "requests_with_hits": len(hits),
        "hit_tokens": sum(r.get("cached", 0) for r in requests),
        "compared": len(compared),
        "compared_hits": sum(1 for r in compared if r["start"] > 0),
        "wrong_outputs": sum(1 for r in compared if not r["match"]),
        "reference_mismatched_prefix": sum(1 for r in compared
                                           if r["ref_cached"] != r["start"] or not r["ref_steps_ok"]),
        "kills_survived": len(result.get("kills", [])),
        "kills_during_stream": sum(1 for k in result.get("kills", []) if k.get("request") is not None),
        "max_plan_forwards": max((len(r.get("plan", ())) for r in requests), default=0),
    }


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, default="nvme")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32, help="at least this many (more while kills remain)")
    ap.add_argument("--docs", type=int, default=4, help="documents asked again and again")
    ap.add_argument("--seed", type=int, default=14)
    a = ap.parse_args()
    os.environ.update(driver_env())
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ucm-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # away from a source checkout (stale ucm.egg-info)
    result = chaos(a.variant, work, a.kills, a.requests, a.seed, a.docs)
    Path(a.out).write_text(json.dumps(result, indent=1))
    brief = {k: v for k, v in result.items() if k != "requests"}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
