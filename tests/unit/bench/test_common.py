"""ucm.bench.common: a bench's flags, where its log goes, what it prints and
how it fails (stdout carries only the JSON under --json)."""
import argparse
import json

import pytest

from ucm.bench import common
from ucm.errors import ArgumentError


def _parser():
    top = argparse.ArgumentParser(prog="ucm bench")
    sub = top.add_subparsers(dest="bench", required=True)

    def add_args(p):
        common.add_counts(p, docs=(4, "documents"), doc_tokens=(3000, "tokens per document"))
        common.add_json_flag(p)

    p = common.add_bench(sub, "demo", help="a bench", description="What it does.", add_args=add_args,
                         handler=lambda args: 7)
    return top, p


def test_a_registered_bench_has_its_flags_defaults_help_and_handler():
    top, p = _parser()
    args = top.parse_args(["demo", "--doc-tokens", "10"])
    assert (args.docs, args.doc_tokens, args.json, args.handler(args)) == (4, 10, False, 7)
    assert "tokens per document (default 3000)" in p.format_help()


def test_require_positive_names_the_flag_and_its_value():
    with pytest.raises(ArgumentError, match="--doc-tokens must be > 0, got 0"):
        common.require_positive(argparse.Namespace(docs=1, doc_tokens=0), ("docs", "doc_tokens"))


@pytest.mark.parametrize("json_out", [True, False])
def test_progress_goes_to_stderr_under_json_and_the_result_is_printed_once(capsys, json_out):
    def measure(log):
        log("working")
        return {"b": 1, "a": 2}

    status = common.run_measured(argparse.Namespace(json=json_out), "demo", measure,
                                 lambda r: common.key_values(r, 4), sort_keys=True)
    out, err = capsys.readouterr()
    assert status == 0
    if json_out:
        assert json.loads(out) == {"a": 2, "b": 1} and err == "working\n"
    else:
        assert out == "working\na    2\nb    1\n" and err == ""


def test_an_expected_failure_is_one_line_on_stderr_and_exit_1(capsys):
    def measure(log):
        raise ValueError("--repeat must be >= 1, got 0")

    assert common.run_measured(argparse.Namespace(json=True), "demo", measure, str) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "ucm bench demo: --repeat must be >= 1, got 0\n"


def test_figures():
    assert common.gbps(3 * 10**9, 2.0) == 1.5 and common.gbps(1, 0.0) == float("inf")
    assert common.nearest_rank([5, 1, 4, 2, 3], 0.5) == 3 and common.nearest_rank([1, 2], 0.99) == 2
