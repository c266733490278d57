"""ucm.service.paths (stale segments of dead services) and the service's
landing-tier check (the data plane is whichever tier declares SharedSlots)."""
import os
import subprocess
import sys

import pytest

from ucm.config.schema import load_config
from ucm.errors import ConfigError
from ucm.service.paths import record_segment_dir, recorded_segment_dir, remove_stale_segments, segment_prefix


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_segments_of_dead_services_of_this_user_are_removed(tmp_path):
    dead = tmp_path / f"{segment_prefix()}{dead_pid()}-ab12"
    alive = tmp_path / f"{segment_prefix()}{os.getpid()}-cd34"
    other_user = tmp_path / f"ucm-{os.getuid() + 1}-{dead_pid()}-ef56"
    unrelated = tmp_path / "notes.txt"
    for f in (dead, alive, other_user, unrelated):
        f.write_bytes(b"x")
    assert remove_stale_segments(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (alive, other_user, unrelated))
    assert remove_stale_segments(str(tmp_path / "missing")) == 0


def test_the_segment_directory_is_recorded_beside_the_socket(tmp_path):
    sock = str(tmp_path / "s.sock")
    assert recorded_segment_dir(sock) is None
    record_segment_dir(sock, "/dev/shm")
    assert recorded_segment_dir(sock) == "/dev/shm"
    record_segment_dir(sock, "relative/dir")  # never trusted: not absolute
    assert recorded_segment_dir(sock) is None


def test_the_landing_tier_must_declare_shared_slots(tmp_path):
    from ucm.service.server.serve import check_landing_tier

    tiers = [{"adapter": "dram", "capacity": "4MiB"},
             {"adapter": "nvme", "capacity": "32MiB", "options": {"path": str(tmp_path)}}]
    check_landing_tier(load_config({"tiers": tiers}))
    with pytest.raises(ConfigError, match=r"landing_tier: .*got 'nvme'; tiers here that qualify: \['dram'\]"):
        check_landing_tier(load_config({"tiers": tiers, "landing_tier": "nvme"}))
