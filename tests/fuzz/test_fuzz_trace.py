"""The trace parser on random and mutated JSONL: every line is a
TraceRequest that keeps the format's invariants or a TraceError naming its
line number; nothing else escapes."""
import json
import math

import pytest

from fuzzing import SEED, examples, mutate, rng, value
from ucm.errors import TraceError
from ucm.bench.cache.traces import MAX_HASH_ID, TraceRequest, iter_trace, parse_line, read_trace


def good_line(rnd):
    n = rnd.randrange(0, 6)
    obj = {"timestamp": rnd.choice((0, rnd.randrange(1 << 40), rnd.random() * 1e6)),
           "input_length": rnd.randrange(0, 512 * 6), "hash_ids": rnd.sample(range(1 << 20), n)}
    if rnd.random() < 0.5:
        obj["output_length"] = rnd.randrange(0, 2048)
    return json.dumps(obj)


def check(text, line):
    """parse_line's answer, with the invariants a replay relies on."""
    try:
        req = parse_line(text, line)
    except TraceError as exc:
        assert f"line {line}" in str(exc), (SEED, text, exc)
        return None
    assert isinstance(req, TraceRequest) and req.line == line
    assert type(req.timestamp_ms) is float and math.isfinite(req.timestamp_ms)
    assert type(req.input_length) is int and req.input_length >= 0
    assert type(req.output_length) is int and req.output_length >= 0
    assert all(type(h) is int and 0 <= h <= MAX_HASH_ID for h in req.hash_ids)
    assert len(set(req.hash_ids)) == len(req.hash_ids)
    tokens = req.block_tokens(512)
    assert len(tokens) == len(req.hash_ids) and all(1 <= t <= 512 for t in tokens)
    if len(req.hash_ids) == -(-req.input_length // 512):  # a consistent record: the blocks hold the input
        assert sum(tokens) == req.input_length
    return req


def test_mutated_lines_parse_or_raise_trace_error():
    rnd = rng("trace_mutated")
    parsed = refused = 0
    for n in range(examples(5000)):
        raw = good_line(rnd).encode()
        text = mutate(rnd, raw).decode("utf-8", errors=rnd.choice(("replace", "surrogateescape", "ignore")))
        if check(text, n + 1) is None:
            refused += 1
        else:
            parsed += 1
    assert parsed and refused


def test_random_json_values_parse_or_raise_trace_error():
    rnd = rng("trace_values")
    fields = ("timestamp", "input_length", "output_length", "hash_ids")
    for n in range(examples(5000)):
        obj = json.loads(good_line(rnd))
        for name in rnd.sample(fields, rnd.randint(1, 2)):
            if rnd.random() < 0.2:
                obj.pop(name, None)
            else:
                obj[name] = value(rnd, 2, binary=False)
        if rnd.random() < 0.1:
            obj = value(rnd, 3, binary=False)
        check(json.dumps(obj), n + 1)


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # nesting past the JSON decoder's recursion limit
    '{"a":' * 50_000 + "1" + "}" * 50_000,
    '{"timestamp": 1, "input_length": 1' + "0" * 5000 + ', "hash_ids": []}',  # an int past 4300 digits
    '{"timestamp": 1e999, "input_length": 1, "hash_ids": []}',
    '{"timestamp": NaN, "input_length": 1, "hash_ids": []}',
    '{"timestamp": 1, "input_length": 1, "hash_ids": [1, 1]}',
    '{"timestamp": 1, "input_length": true, "hash_ids": []}',
    '{"timestamp": 1, "input_length": 1, "hash_ids": [18446744073709551616]}',
    '{"timestamp": 1, "input_length": 1, "hash_ids": {}}',
    "\ufeff{}",
    "\x00",
])
def test_hostile_lines_raise_trace_error_naming_the_line(text):
    with pytest.raises(TraceError, match="^line 7: "):
        parse_line(text, 7)


def test_random_files_read_or_raise_trace_error(tmp_path):
    rnd = rng("trace_files")
    path = tmp_path / "trace.jsonl"
    for n in range(examples(400)):
        lines = [good_line(rnd).encode() for _ in range(rnd.randrange(1, 6))]
        if rnd.random() < 0.7:
            i = rnd.randrange(len(lines))
            lines[i] = mutate(rnd, lines[i])  # may hold a newline, a NUL or bytes that are not UTF-8
        path.write_bytes(b"\n".join(lines) + rnd.choice((b"", b"\n", b"\r\n", b"\n\n")))
        try:
            reqs = read_trace(path)
        except TraceError as exc:
            assert str(exc).startswith("line ") or str(path) in str(exc), (SEED, n, exc)
            continue
        assert [r.line for r in reqs] == sorted({r.line for r in reqs})
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path)  # a directory


def test_iter_trace_numbers_lines_from_one_and_skips_blank_ones():
    lines = ["", good_line(rng("iter")), "   ", '{"timestamp": 1}']
    with pytest.raises(TraceError, match="^line 4: missing field 'input_length'"):
        list(iter_trace(lines))
    assert [r.line for r in iter_trace(lines[:3])] == [2]
