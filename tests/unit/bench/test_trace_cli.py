"""`ucm bench trace` from the command line."""
import json

import pytest

from ucm.bench.cache.trace import parse_tier_size, parse_tokens
from ucm.cli import main
from ucm.errors import ArgumentError

FIELDS = {"policy", "hit_ratio", "token_hit_ratio", "dram_hits", "nvme_hits", "misses",
          "nvme_bytes_written", "prefill_saved_ratio"}


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = []
    for i in range(60):
        conv = i % 5
        ids = [1000 * conv + j for j in range(2 + i // 10)]
        lines.append(json.dumps({"timestamp": i * 10, "input_length": 512 * len(ids) - 3,
                                 "output_length": 5, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run(capsys, *argv):
    status = main(["bench", "trace", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_json_has_the_fields_of_the_issue(capsys, trace):
    status, out, _ = run(capsys, "--trace", str(trace), "--policy", "lru,heat,opt",
                         "--capacity-tokens", "8K", "--block-bytes", "1000", "--json")
    assert status == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["policy"] for r in rows] == ["lru", "heat", "opt"]
    for r in rows:
        assert FIELDS | {"capacity_tokens"} <= set(r)
        assert r["capacity_tokens"] == 8000
        assert r["hits"] + r["misses"] == r["blocks"] == sum(2 + i // 10 for i in range(60))
        assert r["nvme_hits"] == 0 and r["nvme_bytes_written"] == 0
    assert rows[2]["hit_ratio"] >= max(r["hit_ratio"] for r in rows)


def test_two_tiers_report_each_tier(capsys, trace):
    status, out, _ = run(capsys, "--trace", str(trace), "--policy", "lru", "--dram", "3K",
                         "--nvme", "20000B", "--block-bytes", "1000", "--json")
    assert status == 0
    r = json.loads(out)
    assert FIELDS | {"dram_tokens", "nvme_tokens"} <= set(r)
    assert r["dram_tokens"] == 3000 and r["tiers"][1]["capacity_blocks"] == 20
    assert r["nvme_hits"] > 0 and r["nvme_bytes_written"] > 0


def test_table_and_plot(capsys, trace, tmp_path):
    png = tmp_path / "out" / "hit.png"
    status, out, _ = run(capsys, "--trace", str(trace), "--policy", "all",
                         "--capacity-tokens", "2K,8K", "--block-bytes", "1000", "--plot", str(png))
    assert status == 0
    assert "gap_closed" in out and "heat" in out and "s3fifo" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bandwidths_come_from_ucm_bench_io_output(capsys, trace, tmp_path):
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"dram_load_gbps": 1e-6, "nvme_load_gbps": 1e-6}))
    args = ["--trace", str(trace), "--policy", "lru", "--capacity-tokens", "8K",
            "--block-bytes", "1000000", "--json"]
    _, fast, _ = run(capsys, *args)
    _, slow, _ = run(capsys, *args, "--io-json", str(io))
    assert json.loads(slow)["prefill_saved_ratio"] < json.loads(fast)["prefill_saved_ratio"]


def test_a_malformed_trace_line_exits_2_naming_the_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n'
                    '{"timestamp": 1, "input_length": 10, "hash_ids": [1, "x"]}\n')
    status, _, err = run(capsys, "--trace", str(path), "--policy", "lru",
                         "--capacity-tokens", "1M")
    assert status == 2
    assert err.startswith("ucm: error: line 2: ")


@pytest.mark.parametrize("argv", [
    ["--policy", "lru"],  # no capacity
    ["--policy", "lru", "--dram", "1M"],  # one of two tiers
    ["--policy", "lru", "--capacity-tokens", "1M", "--dram", "1M", "--nvme", "2M"],
    ["--policy", "lru", "--capacity-tokens", "100"],  # not one block
    ["--policy", "lru", "--capacity-tokens", "lots"],
    ["--policy", "nosuch", "--capacity-tokens", "1M"],
    ["--policy", "lru", "--dram", "1M", "--nvme", "2M", "--plot", "x.png"],
])
def test_bad_arguments_exit_2(capsys, trace, argv):
    status, _, err = run(capsys, "--trace", str(trace), *argv)
    assert status == 2 and err.startswith("ucm: error: ")


def test_sizes():
    assert parse_tokens("1M") == 1_000_000 and parse_tokens("2.5k") == 2500
    assert parse_tier_size("1M", 1000, 512) == (1_000_000, 1953 * 1000)
    assert parse_tier_size("64KiB", 1000, 512) == (65 * 512, 65 * 1000)
    with pytest.raises(ArgumentError):
        parse_tier_size("12 parsecs", 1000, 512)


def test_a_codec_ratio_gives_the_nvme_tier_more_blocks_at_equal_bytes(capsys, trace):
    rows = {}
    for ratio in ("1", "2"):
        status, out, _ = run(capsys, "--trace", str(trace), "--policy", "lru", "--dram", "2K", "--nvme", "64KiB",
                             "--block-bytes", "4096", "--codec-ratio", ratio, "--json")
        assert status == 0
        rows[ratio] = json.loads(out.splitlines()[0])
    blocks = {r: [t["capacity_blocks"] for t in row["tiers"]] for r, row in rows.items()}
    assert blocks["1"][1] == 16 and blocks["2"] == [blocks["1"][0], 32]  # 64 KiB of 4 KiB blocks, then twice as many
    assert rows["2"]["hit_ratio"] >= rows["1"]["hit_ratio"]
    status, _, err = run(capsys, "--trace", str(trace), "--policy", "lru", "--capacity-tokens", "8K",
                         "--codec-ratio", "2")
    assert status == 2 and "--codec-ratio" in err
