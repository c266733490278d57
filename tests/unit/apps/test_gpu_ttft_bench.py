"""ucm bench gpu-ttft on the CPU with a tiny random Llama: every variant
runs, the hits restore the whole document and give the reference's first
token, and bad shapes are refused naming the flag."""
import argparse

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ucm.bench.engines.gpu_ttft_bench import VARIANTS, _check, gpu_ttft  # noqa: E402
from ucm.errors import ArgumentError  # noqa: E402


def test_every_variant_runs_and_the_hits_equal_the_reference():
    res = gpu_ttft("cpu", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256,
                   doc_tokens=256, block_tokens=64, rounds=2)
    assert res["device"] == "cpu" and res["restored_tokens"] == 256
    assert res["outputs_equal"] is True
    for k in VARIANTS:
        assert len(res["samples_ttft_s"][k]) == 2 and res[k + "_ttft_s"] > 0
    assert res["connector"]["hbm_front"]["front_hit_blocks"] >= 2 * 4  # both rounds from the front
    assert res["connector"]["dram"]["hit_blocks"] >= 2 * 4


def _args(**kw):
    base = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256, doc_tokens=256,
                block_tokens=64, rounds=2)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("kw,flag", [({"rounds": 0}, "--rounds"), ({"heads": 3}, "--hidden"),
                                     ({"kv_heads": 3}, "--kv-heads"), ({"doc_tokens": 32}, "--doc-tokens")])
def test_bad_shapes_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ArgumentError, match=flag):
        _check(_args(**kw))
