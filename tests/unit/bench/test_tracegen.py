"""`ucm bench tracegen`: seeded Mooncake-format workloads with chained ids."""
import json

import pytest

from ucm.bench.cache.tracegen import WORKLOADS, generate
from ucm.cli import main
from ucm.errors import ArgumentError
from ucm.bench.cache.traces import BLOCK_TOKENS, parse_line


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_workload_is_a_valid_trace_of_chained_ids(name):
    recs = list(generate(name, 300, seed=5))
    assert len(recs) == 300
    parent = {}
    times = [r["timestamp"] for r in recs]
    assert times == sorted(times)
    for i, r in enumerate(recs):
        req = parse_line(json.dumps(r), i + 1)
        assert len(req.hash_ids) == -(-req.input_length // BLOCK_TOKENS)
        for pos, h in enumerate(req.hash_ids):  # equal ids mean equal prefixes
            before = req.hash_ids[pos - 1] if pos else None
            assert parent.setdefault(h, before) == before


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_conversations_extend_earlier_prompts(name):
    recs = list(generate(name, 300, seed=2))
    seen = set()
    reused = 0
    for r in recs:
        reused += sum(h in seen for h in r["hash_ids"])
        seen.update(r["hash_ids"])
    assert reused > 0.3 * sum(len(r["hash_ids"]) for r in recs)


def test_same_seed_same_trace_other_seed_other_trace():
    assert list(generate("rag", 100, seed=1)) == list(generate("rag", 100, seed=1))
    assert list(generate("rag", 100, seed=1)) != list(generate("rag", 100, seed=2))


def test_cli_writes_the_requested_number_of_lines(tmp_path):
    out = tmp_path / "scan.jsonl"
    assert main(["bench", "tracegen", "--workload", "scan", "--requests", "50", "--seed", "4",
                 "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 50


def test_bad_arguments_are_errors():
    with pytest.raises(ArgumentError, match="requests"):
        list(generate("chat", 0))
    with pytest.raises(ArgumentError, match="unknown workload"):
        list(generate("nope", 10))
