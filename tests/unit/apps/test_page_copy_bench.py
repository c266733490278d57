"""ucm bench pages on the CPU with a small geometry: every part runs (the
service stores and loads every block, or the bench fails), the figures are
the payload over the median seconds, and bad arguments are refused naming
the flag."""
import argparse

import pytest

pytest.importorskip("torch")

from ucm.bench.engines.page_copy_bench import _check, pages_bench  # noqa: E402
from ucm.errors import ArgumentError  # noqa: E402


def test_every_part_runs_and_reports_gb_per_second_of_the_payload():
    res = pages_bench("cpu", layers=2, kv_heads=2, head_size=64, page_tokens=16, block_tokens=64, blocks=4,
                      rounds=3)
    assert res["block_bytes"] == 2 * 4 * (2 * 16 * 2 * 64 * 2)  # layers x pages x (K and V of a page, bf16)
    assert res["bytes_per_round"] == 4 * res["block_bytes"]
    want = {"memcpy_h2d", "memcpy_d2h", "copier_save", "copier_load", "copier_save_1", "copier_load_1",
            "service_save", "service_load"}
    assert set(res["gbps"]) == want and set(res["seconds"]) == want  # no pageable rows without CUDA
    for k, secs in res["seconds"].items():
        assert len(secs) == 3  # the warm-up round is not among them
        median = sorted(secs)[1]
        assert res["gbps"][k] == pytest.approx(res["bytes_per_round"] / median / 1e9, rel=0.01, abs=0.01)
    assert res["arena_registered"] is False and res["service_arena_registered"] is False


@pytest.mark.parametrize("flag,value", [("blocks", 0), ("rounds", -1), ("page_tokens", 0)])
def test_bad_sizes_are_refused_naming_the_flag(flag, value):
    args = argparse.Namespace(layers=2, kv_heads=2, head_size=64, page_tokens=16, block_tokens=64, blocks=4,
                              rounds=3)
    setattr(args, flag, value)
    with pytest.raises(ArgumentError, match="--" + flag.replace("_", "-")):
        _check(args)


def test_a_block_that_is_not_whole_pages_is_refused():
    args = argparse.Namespace(layers=2, kv_heads=2, head_size=64, page_tokens=16, block_tokens=40, blocks=4,
                              rounds=3)
    with pytest.raises(ArgumentError, match="--block-tokens"):
        _check(args)
