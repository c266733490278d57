"""`ucm bench pd`'s own arithmetic (ucm/bench/engines/pd_bench.py): the
seeded load, and the summary of streamed rows against the reference."""
import argparse

import pytest

from ucm.bench.engines.pd_bench import _span, _summary, workload


def test_the_load_is_seeded_distinct_and_in_range():
    a, b = workload(12, (100, 200), (8, 16), 2.0, seed=3), workload(12, (100, 200), (8, 16), 2.0, seed=3)
    assert a == b and a != workload(12, (100, 200), (8, 16), 2.0, seed=4)
    assert all(100 <= len(r["tokens"]) <= 200 and 8 <= r["max_tokens"] <= 16 for r in a)
    assert len({tuple(r["tokens"][:32]) for r in a}) == 12  # no two prompts share a prefix block
    assert [r["at"] for r in a] == sorted(r["at"] for r in a) and a[0]["at"] == 0.0


def test_the_summary_counts_stalls_and_checks_outputs():
    rows = [{"index": 0, "sent_s": 0.0, "ttft_s": 1.0, "done_s": 3.0, "tokens": 4, "itl_s": [0.1, 2.5, 0.1],
             "text": "a"},
            {"index": 1, "sent_s": 1.0, "ttft_s": 3.0, "done_s": 5.0, "tokens": 3, "itl_s": [0.2, 0.2], "text": "b"}]
    s = _summary(rows, ["a", "b"], 17)
    assert s["ttft_p50_s"] == 3.0 and s["itl_max_s"] == 2.5 and s["itl_over_1s"] == 1
    assert s["output_tokens_per_s"] == 7 / 5.0 and s["outputs_equal"] and s["decode_computed_tokens_max"] == 17
    failed = _summary([rows[0], {"index": 1, "error": "HTTP 500", "sent_s": 1.0}], ["a", "b"], None)
    assert failed["failed"] == 1 and not failed["outputs_equal"] and failed["outputs_matching"] == 1
    assert not _summary(rows, ["a", "c"], None)["outputs_equal"]


def test_ranges_are_typed_errors():
    assert _span("1024-2048") == (1024, 2048) and _span("64") == (64, 64)
    for bad in ("0-10", "20-10", "x"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            _span(bad)


def test_a_step_budget_that_is_not_positive_is_refused_before_any_server():
    from ucm.bench.engines.pd_bench import run
    from ucm.errors import ArgumentError

    args = argparse.Namespace(requests=None, interval=None, max_num_batched_tokens=0,
                              prefill_max_num_batched_tokens=None)
    with pytest.raises(ArgumentError, match="--max-num-batched-tokens must be > 0"):
        run(args)
    args = argparse.Namespace(requests=None, interval=None, max_num_batched_tokens=None,
                              prefill_max_num_batched_tokens=-256)
    with pytest.raises(ArgumentError, match="--prefill-max-num-batched-tokens must be > 0"):
        run(args)


def test_in_shortest_order_a_request_carries_its_prompts_length_as_priority():
    from ucm.bench.engines.pd_bench import _body

    r = workload(1, (100, 200), (8, 16), 2.0, seed=3)[0]
    assert "priority" not in _body(r, 8)
    assert _body(r, 8, priority=True)["priority"] == len(r["tokens"])
