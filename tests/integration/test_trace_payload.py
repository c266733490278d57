"""`ucm bench trace --bytes`: a replay with real payloads through a UnifiedCache
(dram adapter, nvme adapter on real files) takes the same decisions as the
metadata replay, and every hit reads back the bytes stored."""
import json

import pytest

from ucm.bench.cache.payload import run_payload
from ucm.bench.cache.replay import CostModel
from ucm.bench.cache.trace import run_one
from ucm.bench.cache.tracegen import generate
from ucm.cli import main
from ucm.bench.cache.traces import parse_line

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


@pytest.mark.parametrize("policy", ["lru", "heat"])
@pytest.mark.parametrize("blocks", [(40,), (40, 120)], ids=["dram", "dram+nvme"])
def test_live_replay_in_the_connector_call_sequence_keeps_the_policy_figures(requests, nvme_dir, policy,
                                                                             blocks):
    """The cache driven as the vLLM connector drives it (one begin_request,
    then lookup, pin, read_slots, chunked write_slots, finish) hits exactly
    as often as the metadata replay that measures the policies: the heat
    clock ticks once per request on the live path too. (Which tier serves a
    hit may differ: a reader stages what it needs without asking the
    policy, the replay promotes what the policy admits.) DRAM holds several
    prompts here; with a DRAM of about one prompt (12 blocks) a reader's
    staging of an NVMe hit can find no room and the live path hits less:
    docs/lab/design-notes.md, "Requests as events".)"""
    from ucm.bench.cache.live import run_live

    names = ("dram", "nvme")[:len(blocks)]
    tiers = [(n, b * 512, b * SIZE) for n, b in zip(names, blocks)]
    cost = CostModel(block_bytes=SIZE, tier_gbps=(20.0, 5.0))
    meta = run_one(requests, policy, tiers, cost)
    live, counts = run_live(requests, policy, tiers, cost, nvme_dir=nvme_dir, chunk_blocks=2)
    assert live.hits == meta.hits > 0
    assert live.misses == meta.misses
    assert live.hit_tokens == meta.hit_tokens
    assert counts.mismatches == 0 and counts.short_reads == 0
    assert counts.write_calls > live.requests  # chunked: several saves per request
    if len(blocks) == 1:
        assert live.tier_hits == meta.tier_hits


def test_cli_live_reports_the_live_counters(tmp_path, nvme_dir, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in generate("agent", 60, seed=1)))
    status = main(["bench", "trace", "--trace", str(trace), "--policy", "lru", "--dram", "20K",
                   "--nvme", "60K", "--bytes", "8KiB", "--bytes-dir", nvme_dir, "--limit", "40",
                   "--live", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert status == 0
    assert row["live_mismatches"] == 0 and row["live_write_calls"] >= row["requests"] == 40
