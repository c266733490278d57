"""Reading Mooncake-format traces (ucm/bench/cache/traces.py)."""
import json

import pytest

from ucm.errors import TraceError
from ucm.bench.cache.traces import TraceRequest, iter_trace, read_trace

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [4, 5, 6]}


def write(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_reads_requests_in_order(tmp_path):
    second = dict(GOOD, timestamp=40.5, hash_ids=[4, 5, 9, 10])
    reqs = read_trace(write(tmp_path, [json.dumps(GOOD), "", json.dumps(second)]))
    assert [r.hash_ids for r in reqs] == [(4, 5, 6), (4, 5, 9, 10)]
    assert reqs[1].timestamp_ms == 40.5 and reqs[1].line == 3
    assert reqs[0].output_length == 7


def test_output_length_is_optional():
    (r,) = iter_trace([json.dumps({k: v for k, v in GOOD.items() if k != "output_length"})])
    assert r.output_length == 0


def test_block_tokens_split_the_input():
    r = TraceRequest(1, 0.0, 1100, 0, (1, 2, 3))
    assert r.block_tokens() == [512, 512, 76]
    assert TraceRequest(1, 0.0, 0, 0, ()).block_tokens() == []


@pytest.mark.parametrize("bad", [
    "{not json",
    "[1, 2]",
    json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
    json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}),
    json.dumps(dict(GOOD, hash_ids=[1, "2"])),
    json.dumps(dict(GOOD, hash_ids=[1, -2])),
    json.dumps(dict(GOOD, hash_ids=[1, 2.0])),
    json.dumps(dict(GOOD, hash_ids=[1, True])),
    json.dumps(dict(GOOD, hash_ids=[1, 1 << 64])),
    json.dumps(dict(GOOD, hash_ids=[1, 2, 1])),
    json.dumps(dict(GOOD, hash_ids="1,2")),
    json.dumps(dict(GOOD, input_length="1100")),
    json.dumps(dict(GOOD, input_length=-1)),
    json.dumps(dict(GOOD, output_length=1.5)),
    json.dumps(dict(GOOD, timestamp="0")),
    json.dumps(dict(GOOD, timestamp=None)),
])
def test_a_malformed_line_is_an_error_naming_its_number(tmp_path, bad):
    path = write(tmp_path, [json.dumps(GOOD), json.dumps(GOOD), bad, json.dumps(GOOD)])
    with pytest.raises(TraceError, match=r"^line 3: "):
        read_trace(path)


def test_a_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
