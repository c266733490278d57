"""`ucm bench io` end to end on small sizes: every figure is measured and
every byte it moved (adapters and the cache's staging) read back intact."""
from ucm.bench.io import measure


def test_bench_io_measures_and_verifies(tmp_path):
    r = measure(str(tmp_path), size_mb=8, block_bytes=64 * 1024, batch=4, io_threads=4, fio=False)
    assert r["blocks"] == 128
    assert r["dram_ok"] and r["nvme_ok"] and r["stage_ok"]
    for k in ("memcpy_gbps", "dram_store_gbps", "dram_load_gbps", "nvme_store_gbps", "nvme_load_gbps",
              "stage_gbps", "stage_no_headroom_gbps"):
        assert 0 < r[k] < float("inf"), k
