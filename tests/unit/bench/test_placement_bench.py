"""`ucm bench placement`: the JSON document it prints (shape, not speed)."""
import json

from ucm.bench.cache.placement import PATHS, workload
from ucm.cli import main


def test_json_has_both_call_paths_per_policy_and_request_size(capsys):
    status = main(["bench", "placement", "--policy", "lru,heat", "--blocks-per-request", "4,8",
                   "--blocks", "16", "--repeat", "1", "--json"])
    assert status == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bench"] == "placement" and doc["unit"] == "us_per_block"
    rows = doc["results"]
    assert [(r["policy"], r["blocks_per_request"]) for r in rows] == [
        ("lru", 4), ("lru", 8), ("heat", 4), ("heat", 8)]
    for r in rows:
        for path in PATHS:
            assert isinstance(r[f"{path}_us_per_block"], float) and r[f"{path}_us_per_block"] > 0
        assert r["same_decisions"] is True  # the batched call decides as the per-block calls do
        assert r["evictions"] > 0  # steady state: the tiers were full and churning
        assert r["dram_blocks"] == 2 * r["blocks_per_request"]


def test_every_installed_policy_runs_by_default(capsys):
    from ucm.placement.policies.base import policy_names

    assert main(["bench", "placement", "--blocks-per-request", "2", "--blocks", "4",
                 "--repeat", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["policy"] for r in rows] == policy_names()
    assert all(r["same_decisions"] for r in rows)


def test_bad_arguments_exit_2_naming_the_flag(capsys):
    assert main(["bench", "placement", "--policy", "nope"]) == 2
    assert "--policy: unknown ['nope']" in capsys.readouterr().err
    assert main(["bench", "placement", "--blocks-per-request", "0"]) == 2
    assert "--blocks-per-request" in capsys.readouterr().err


def test_workload_is_seeded_and_reuses_prefixes():
    a, b = workload(8, 30, seed=3), workload(8, 30, seed=3)
    assert a == b and all(len(keys) == 8 for keys in a)
    seen = set()
    reused = 0
    for keys in a:
        reused += keys[0] in seen
        seen.update(keys)
    assert reused > 0
