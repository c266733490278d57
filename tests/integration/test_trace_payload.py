"""`ucm bench trace --bytes`: a replay with real payloads through a UnifiedCache
(dram adapter, nvme adapter on real files) takes the same decisions as the
metadata replay, and every hit reads back the bytes stored."""
import json

import pytest

from ucm.bench.payload import run_payload
from ucm.bench.replay import CostModel
from ucm.bench.trace import run_one
from ucm.bench.tracegen import generate
from ucm.cli import main
from ucm.trace import parse_line

SIZE = 8192  # bytes per block: small, a multiple of the 4 KiB slot and log alignment


@pytest.fixture(scope="module")
def requests():
    recs = generate("chat", 300, seed=3)
    return [parse_line(json.dumps(r), i + 1) for i, r in enumerate(recs)]


@pytest.mark.parametrize("policy", ["lru", "heat", "opt"])
@pytest.mark.parametrize("blocks", [(40,), (12, 40)], ids=["dram", "dram+nvme"])
def test_payload_replay_hits_and_misses_equal_the_metadata_replay(requests, nvme_dir, policy,
                                                                  blocks):
    names = ("dram", "nvme")[:len(blocks)]
    tiers = [(n, b * 512, b * SIZE) for n, b in zip(names, blocks)]
    cost = CostModel(block_bytes=SIZE, tier_gbps=(20.0, 5.0))
    meta = run_one(requests, policy, tiers, cost)
    real, counts = run_payload(requests, policy, tiers, cost, nvme_dir=nvme_dir)
    assert real.hits == meta.hits > 0
    assert real.misses == meta.misses
    assert real.tier_hits == meta.tier_hits
    assert real.tier_bytes_written == meta.tier_bytes_written
    assert counts.mismatches == 0 and counts.read_errors == 0 and counts.failed_steps == 0
    assert counts.blocks_read == real.hits


def test_cli_bytes_reports_the_payload_check(tmp_path, nvme_dir, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in generate("agent", 60, seed=1)))
    status = main(["bench", "trace", "--trace", str(trace), "--policy", "lru", "--dram", "20K",
                   "--nvme", "60K", "--bytes", "8KiB", "--bytes-dir", nvme_dir, "--limit", "40",
                   "--json"])
    row = json.loads(capsys.readouterr().out)
    assert status == 0
    assert row["payload_block_bytes"] == 8192 and row["payload_mismatches"] == 0
    assert row["payload_blocks_read"] == row["hits"] > 0
    assert row["requests"] == 40
