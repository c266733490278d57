"""`ucm bench soak`, short: clients storing, loading and looking up while
some are SIGKILLed; every loaded byte is checked, and once the clients are
gone the service holds nothing for them and has leaked nothing."""
import json
import subprocess
import sys


def test_a_short_soak_with_kills_loses_nothing_and_serves_no_wrong_byte():
    r = subprocess.run([sys.executable, "-m", "ucm.cli", "bench", "soak", "--minutes", "0.2", "--clients", "3",
                        "--kill-every-s", "2", "--seed", "7", "--json"],
                       capture_output=True, text=True, timeout=300)
    res = json.loads(r.stdout)
    assert res["client_kills"] >= 2  # the run did kill clients mid-work
    assert res["blocks_verified"] > 0 and res["store_ops"] > 0 and res["lookup_ops"] > 0
    assert res["wrong_bytes"] == 0 and res["wrong_blocks"] == 0, res["errors"]
    assert (res["exceptions"], res["timeouts"], res["bad_lookups"], res["client_crashes"]) == (0, 0, 0, 0), \
        res["errors"]
    assert res["service_alive"] and res["service_exit"] == 0
    assert (res["leases_left"], res["connections_left"], res["dram_orphan_slots"]) == (0, 0, 0)
    assert res["refill_ok"]
    assert res["fds_end"] <= res["fds_start"]
    assert res["shm_files_left"] == [] and res["shm_files_max"] == res["shm_files_start"] >= 1
    assert res["ok"] and r.returncode == 0, r.stderr
