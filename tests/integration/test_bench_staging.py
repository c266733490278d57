"""`ucm bench placement --service`: stores and lookups through ucm serve,
alone and while a client stages from NVMe (shape and liveness, not speed)."""
import pytest

from ucm.bench.cache import staging
from ucm.cli import main
from ucm.errors import ArgumentError


def test_both_phases_store_look_up_and_stage(monkeypatch, tmp_path):
    monkeypatch.setattr(staging, "BLOCK_BYTES", 64 * 1024)
    doc = staging.run(None, clients=2, blocks=4, seconds=0.5, tmp_dir=str(tmp_path))
    cur = doc["current"]
    assert doc["clients"] == 2 and doc["block_bytes"] == 64 * 1024 and "baseline" not in doc
    assert cur["alone"]["stores_per_s"] > 0 and cur["alone"]["lookups_per_s"] > 0
    assert cur["with_staging"]["stores_per_s"] > 0
    assert cur["with_staging"]["staged_blocks_per_s"] > 0  # the stager's loads came back DONE
    assert doc["repeat"] == 1 and len(cur["store_ratios"]) == 1 and 0 < cur["store_ratio"]


def test_a_baseline_that_is_no_source_tree_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="not a ucm source tree"):
        staging.run(str(tmp_path))


def test_baseline_needs_service(capsys):
    assert main(["bench", "placement", "--policy", "lru", "--blocks-per-request", "4", "--blocks", "8",
                 "--repeat", "1", "--baseline", "/tmp"]) == 2
    assert "give --service too" in capsys.readouterr().err
