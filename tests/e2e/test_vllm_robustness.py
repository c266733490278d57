"""End to end, robustness: UCMConnector inside vLLM for CPU with
SmolLM2-135M-Instruct against a standalone `ucm serve` that the driver
(this file run as a script) kills and restarts: partial hits, concurrent
requests, the service gone mid-batch and back. The prompts, engines and
helpers are test_vllm_connector.py's; the engines run in E2E_DTYPE with
VLLM_CPU_KVCACHE_SPACE=1 and VLLM_CPU_OMP_THREADS_BIND=0-1."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_vllm_connector import (BLOCK_BYTES, BLOCK_TOKENS, TEXT, _engine, _model_id, _prompts, _run,  # noqa: E402
                                 _run_many)
from vllm_support import E2E_DTYPE, close_engine, driver_main, run_driver, scaled_mib  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()


@pytest.mark.timeout(900)
def test_ucm_connector_partial_concurrent_and_service_faults(tmp_path):
    """The driver (this file as a script), two engines: a reference without a
    connector (vLLM prefix caching) and one ucm engine that lives through
    every check, against a standalone `ucm serve` the driver kills and
    restarts:
    - partial prefix hit: Q shares only P1's first block; ucm serves 128
      tokens, like vLLM's own cache after P1;
    - several concurrent requests in one `generate` call, all hits;
    - the service SIGKILLed while requests run: every request completes,
      its tokens equal the reference's on as much of the prefix as ucm
      delivered before the kill (none, the first block, or both);
    - the service restarted with the same config after its blocks were
      demoted to NVMe and flushed: the same engine hits again (from NVMe)."""
    r = run_driver(HERE, tmp_path, 850)
    ref, u = r["reference"], r["ucm"]
    # Partial prefix hit: one of Q's two full blocks is cached, in both.
    assert ref["q_hit"]["cached"] == 128 and u["q"]["cached"] == 128
    assert u["q"]["tokens"] == ref["q_hit"]["tokens"]
    # Cold runs with the connector equal the no-connector cold runs.
    for name in ("p1", "c1", "c2"):
        assert u[name + "_cold"]["cached"] == 0
        assert u[name + "_cold"]["tokens"] == ref[name + "_cold"]["tokens"], name
    # Several concurrent requests, all hits from ucm, equal vLLM's own concurrent hits.
    assert [o["cached"] for o in ref["batch_hit"]] == [256, 256, 256]
    assert [o["cached"] for o in u["batch"]] == [256, 256, 256]
    assert [o["tokens"] for o in u["batch"]] == [o["tokens"] for o in ref["batch_hit"]]
    # The service was killed while the batch ran; every request still completed correctly.
    assert r["killed_during_run"], "the kill came after the batch had finished"
    # Each request computed on what ucm delivered before the kill: nothing,
    # its first block, or both; its tokens equal vLLM's own run on as much.
    names = ["p1", "c1", "c2", "d"]
    for name in names[:3]:
        assert ref[name + "_half"]["cached"] == BLOCK_TOKENS
    for name, o in zip(names, u["batch_killed"]):
        allowed = [ref[name + suffix]["tokens"] for suffix in ("_cold", "_half", "_hit") if name + suffix in ref]
        assert o["tokens"] in allowed, (name, o)
    assert u["after_kill"]["cached"] == 0 and u["after_kill"]["tokens"] == ref["p1_cold"]["tokens"]
    # Restarted with the same config: the NVMe blocks are found, the same engine hits again.
    assert r["restart_lookup"] == 2 and r["restart_pid"] != r["first_pid"]
    assert u["after_restart"]["cached"] == 256
    assert u["after_restart"]["tokens"] == ref["p1_hit"]["tokens"]


# ---- the driver (runs in its own process; vLLM needs the __main__ guard) ------
def _more_prompts(tokenizer, p1: list[int]) -> dict[str, list[int]]:
    """Q: P1's first block + another 172 tokens (a partial prefix hit after
    P1); C1, C2, D: other 300-token prompts (D only ever runs cold)."""
    words = TEXT.split()
    def text(seed: int) -> list[int]:
        import random

        rng = random.Random(seed)
        w = words[:]
        rng.shuffle(w)
        ids = tokenizer.encode(" ".join(w * 2), add_special_tokens=False)
        return ids[:300]
    q = p1[:128] + text(1)[:172]
    return {"q": q, "c1": text(2), "c2": text(3), "d": text(4)}


def _start_service(cfg_path: Path, work: Path) -> subprocess.Popen:
    log = open(work / "serve.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", str(cfg_path)],
                            cwd=str(work), stdout=log, stderr=log, stdin=subprocess.DEVNULL)


def _wait_service(client, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = client.stats()
        if st and "service" in st:
            return st
        time.sleep(0.2)
    raise SystemExit("ucm service did not come up")


def _demote_and_flush(client, n: int = 8) -> None:
    import torch

    fill = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    for _ in range(n):
        client.store([os.urandom(16)], [fill]).wait(30)
    client.flush()


def _robustness_driver(out: Path, work: Path) -> int:
    import yaml

    from ucm.keys import Namespace, block_keys
    from ucm.apps.model import prepare
    from ucm.service.client.cache_client import CacheClient

    model = str(prepare("smollm2"))
    cfg = {
        "block_tokens": BLOCK_TOKENS,
        "tiers": [
            {"adapter": "dram", "capacity": scaled_mib(32), "options": {"path": "/dev/shm", "prefault": False}},
            {"adapter": "nvme", "capacity": scaled_mib(512),
             "options": {"path": str(work / "nvme"), "region_size": scaled_mib(8), "direct_io": False}},
        ],
        "policy": {"name": "lru"},
        "service": {"name": "e2e-vllm-faults", "socket": str(work / "ucm.sock"), "metrics_port": None},
    }
    (work / "nvme").mkdir(exist_ok=True)
    os.chdir(work)  # away from a source checkout (stale ucm.egg-info)
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    p1, _ = _prompts(tok)
    more = _more_prompts(tok, p1)
    q, c1, c2, d = more["q"], more["c1"], more["c2"], more["d"]
    ns = Namespace(model=_model_id(model), kv_dtype=E2E_DTYPE, num_layers=30, num_kv_heads=3, head_size=64,
                   block_tokens=BLOCK_TOKENS, layout="vllm-cpu-page128")
    result: dict = {}
    svc = _start_service(cfg_path, work)
    client = CacheClient(str(work / "ucm.sock"))
    try:
        result["first_pid"] = _wait_service(client)["service"]["pid"]
        llm = _engine(model, None, prefix_caching=True)
        ref = {"p1_cold": _run(llm, p1), "p1_hit": _run(llm, p1), "q_hit": _run(llm, q)}
        for name, p in (("c1", c1), ("c2", c2)):
            ref[name + "_cold"] = _run(llm, p)
            ref[name + "_hit"] = _run(llm, p)
        ref["d_cold"] = _run(llm, d)
        ref["batch_hit"] = _run_many(llm, [p1, c1, c2])
        # A load cut short by the kill keeps the blocks that arrived: the
        # reference for that is vLLM's own hit of the first block only.
        for name, p in (("p1", p1), ("c1", c1), ("c2", c2)):
            llm.reset_prefix_cache()
            _run(llm, p[:BLOCK_TOKENS + 1])  # caches the first block alone
            ref[name + "_half"] = _run(llm, p)
        result["reference"] = ref
        close_engine(llm)

        llm = _engine(model, str(cfg_path), prefix_caching=False)
        u: dict = {"p1_cold": _run(llm, p1), "q": _run(llm, q), "c1_cold": _run(llm, c1), "c2_cold": _run(llm, c2)}
        u["batch"] = _run_many(llm, [p1, c1, c2])
        _demote_and_flush(client, 16)  # P1, C1, C2 now only on NVMe (11 DRAM slots)
        result["tiers_before_kill"] = client.locate(block_keys(ns, p1) + block_keys(ns, c1) + block_keys(ns, c2))

        pid = result["first_pid"]
        t_kill: list[float] = []

        def kill() -> None:
            time.sleep(0.3)
            os.kill(pid, signal.SIGKILL)
            t_kill.append(time.monotonic())

        killer = threading.Thread(target=kill)
        killer.start()
        # One request at a time: a batch's numerics depend on its composition,
        # and a request's reference must be a run on the same prefix alone.
        u["batch_killed"] = [_run(llm, p) for p in (p1, c1, c2, d)]
        t_done = time.monotonic()
        killer.join()
        svc.wait(10)
        result["killed_during_run"] = bool(t_kill) and t_kill[0] < t_done
        u["after_kill"] = _run(llm, p1)  # no service at all: a miss, recomputed

        svc = _start_service(cfg_path, work)
        result["restart_pid"] = _wait_service(client)["service"]["pid"]
        result["restart_lookup"] = client.lookup(block_keys(ns, p1))
        time.sleep(1.0)  # the engine's clients retry their connection every 0.5 s
        u["after_restart"] = _run(llm, p1)
        result["service_after_restart"] = {k: v for k, v in client.stats().items() if not isinstance(v, dict)}
        result["ucm"] = u
        close_engine(llm)
    finally:
        client.close()
        if svc.poll() is None:
            svc.terminate()
            try:
                svc.wait(10)
            except subprocess.TimeoutExpired:
                svc.kill()
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    driver_main(_robustness_driver)
