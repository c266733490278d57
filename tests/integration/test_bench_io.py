"""`ucm bench io` end to end on small sizes: every figure is measured and
every byte it moved (adapters and the cache's staging) read back intact."""
from ucm.bench.cache.io import measure


def test_bench_io_measures_and_verifies(tmp_path):
    r = measure(str(tmp_path), size_mb=8, block_bytes=64 * 1024, batch=4, io_threads=4, fio=False)
    assert r["blocks"] == 128
    assert r["dram_ok"] and r["nvme_ok"] and r["stage_ok"]
    for k in ("memcpy_gbps", "dram_store_gbps", "dram_load_gbps", "nvme_store_gbps", "nvme_load_gbps",
              "stage_gbps", "stage_no_headroom_gbps"):
        assert 0 < r[k] < float("inf"), k


def test_bench_io_range_reads_measure_and_verify(tmp_path):
    from ucm.bench.cache.io import measure_range

    r = measure_range(str(tmp_path), size_mb=4, block_bytes=30 * 96 * 1024, layers=30, batch=4, io_threads=4,
                      chunk_kbs=[32, 64])
    assert r["ok"] and r["blocks"] == 1 and r["layer_bytes"] == 96 * 1024
    c32, c64 = r["by_chunk"]["32768"], r["by_chunk"]["65536"]
    assert c32["range_amplification"] == 1.0  # 96 KiB layers are three 32 KiB chunks
    assert c64["range_amplification"] > 1.0
    assert c32["footer_bytes_per_block"] == 72 + 90 * 8
    for c in (c32, c64):
        for k in ("whole_mbps", "range_mbps", "range_p50_us", "whole_p50_ms"):
            assert 0 < c[k] < float("inf"), k


def test_bench_io_interleaves_nvme_and_fio_on_one_file_in_rounds(tmp_path):
    import shutil

    import pytest

    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (make system-deps)")
    r = measure(str(tmp_path), size_mb=8, block_bytes=64 * 1024, batch=4, io_threads=4, fio=True, repeats=3)
    assert r["nvme_ok"] and r["repeats"] == 3
    rounds = r["rounds"]
    assert rounds["order"] == ["ucm+fio", "fio+ucm", "ucm+fio"]
    for k in ("nvme_store_gbps", "nvme_load_gbps", "fio_write_gbps", "fio_read_gbps"):
        assert len(rounds[k]) == 3 and all(x and x > 0 for x in rounds[k]), (k, rounds[k])
        assert r[k] == sorted(rounds[k])[1]  # the median of the rounds
    assert r["fio_bytes"] == 8 << 20 and r["nvme_store_vs_fio"] > 0 and r["nvme_load_vs_fio"] > 0
