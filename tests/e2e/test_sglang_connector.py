"""ucm as SGLang's HiCache storage, end to end on the real engine (SGLang
for CPU, SmolLM2-135M-Instruct, in .venv-sglang; `make test-sglang`).

Per host layout: a cold request stores pages in ucm; after /flush_cache
(device and host tiers emptied) the same request is served from storage
(`cached_tokens_details`: storage > 0, device 0, UCMStorage) with the same
tokens and logprobs within 1e-3; a new cache_salt gets no hit. A fresh
server process on the same ucm service gets the same hit (checked for one
layout: the keys a process derives do not depend on the host layout, and a
server start is a third of this file's time). On NVMe: bytes
corrupted on the medium are detected and recomputed, never decoded.

The server runs with tests/sglang_cpu on its PYTHONPATH (SGLang's own
device<->host copies on CPU, and two import-only stand-ins); the ucm <->
host pool path is the connector's. A `ucm serve` process is started per
test, so a server restart keeps the cache."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import yaml  # noqa: E402

from ucm.bench.engines.sglang_server import SGLangServer, hicache_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "sglang_cpu"
MODEL = Path.home() / ".cache" / "ucm" / "models" / "smollm2-135m-instruct"
PAGE = 64
PAGE_BYTES = 30 * 3 * 64 * 2 * 2 * PAGE  # layers x KV heads x head size x K|V x bf16 x tokens
PROMPT = [(7919 * i + 13) % 40000 + 100 for i in range(6 * PAGE + 17)]  # 6 full pages and a partial one
NEW_TOKENS = 6

pytestmark = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} missing: run `ucm model prepare smollm2`")


def write_config(tmp_path, name, nvme=False):
    tiers = [{"adapter": "dram", "capacity": "24MiB" if nvme else "256MiB", "options": {"prefault": False}}]
    if nvme:
        (tmp_path / "nvme").mkdir()
        tiers.append({"adapter": "nvme", "capacity": "512MiB",
                      "options": {"path": str(tmp_path / "nvme"), "region_size": "16MiB"}})
    cfg = {"block_tokens": PAGE, "tiers": tiers, "policy": {"name": "lru"},
           "service": {"name": name, "socket": str(tmp_path / "ucm.sock")}}
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


class Service:
    """`ucm serve` for one config, and a client of it."""

    def __init__(self, cfg, tmp_path):
        import ucm

        self.proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", cfg],
                                     stdout=open(tmp_path / "ucm-serve.log", "ab"), stderr=subprocess.STDOUT,
                                     cwd=str(tmp_path))
        deadline = time.monotonic() + 60
        self.client = ucm.connect(cfg, start=False)
        while not self.client.try_connect():
            assert self.proc.poll() is None and time.monotonic() < deadline, "ucm serve did not start"
            time.sleep(0.1)

    def stats(self):
        return self.client.stats()

    def close(self):
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def server(cfg, layout, tmp_path, tag):
    return SGLangServer(sys.executable, str(MODEL), hicache_args(cfg, layout, PAGE) + ["--max-total-tokens", "4096"],
                        pythonpath=[str(SHIM)], log_path=str(tmp_path / f"sglang-{tag}.log"))


def ask(srv, prompt=PROMPT, **extra):
    r = srv.generate(prompt, NEW_TOKENS, logprobs=True, extra=extra or None)
    m = r["meta_info"]
    return {"ids": r["output_ids"], "logprobs": [lp for lp, _, _ in m["output_token_logprobs"]],
            "cached": m.get("cached_tokens", 0), "details": m.get("cached_tokens_details") or {}}


def assert_same(a, b):
    assert a["ids"] == b["ids"]
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-3


def served_from_ucm(r, pages):
    d = r["details"]
    assert d.get("storage", 0) >= pages * PAGE and d.get("device", 0) == 0, r
    assert d.get("storage_backend") == "UCMStorage", r


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_cold_flush_hit_restart_and_salt(tmp_path, layout):
    cfg = write_config(tmp_path, f"e2e-sgl-{layout}-{os.getpid()}")
    svc = Service(cfg, tmp_path)
    try:
        with server(cfg, layout, tmp_path, "a") as srv:
            cold = ask(srv)
            assert cold["cached"] == 0
            # The exact reference of a hit is SGLang's own prefix reuse of the same length: a cold
            # prefill computes the tail in another shape, which on a CPU with AMX moves bf16 logits.
            own = ask(srv)
            assert own["cached"] == 6 * PAGE and own["details"].get("device", 0) == 6 * PAGE, own
            deadline = time.monotonic() + 30  # write-through runs in SGLang's backup thread
            while svc.stats()["stored_blocks"] < 6 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert svc.stats()["stored_blocks"] >= 6
            srv.flush_cache()
            hit = ask(srv)
            served_from_ucm(hit, 6)
            assert_same(hit, own)
            srv.flush_cache()
            salted = ask(srv, cache_salt="another-tenant")
            assert salted["details"].get("storage", 0) == 0
            assert salted["ids"] == cold["ids"]
        if layout != "page_first":
            return
        with server(cfg, layout, tmp_path, "b") as fresh:  # a new SGLang process, the same ucm service
            again = ask(fresh)
            served_from_ucm(again, 6)
            assert_same(again, own)
    finally:
        svc.close()


def test_corrupt_bytes_on_nvme_are_recomputed_never_decoded(tmp_path):
    import numpy as np

    cfg = write_config(tmp_path, f"e2e-sgl-nvme-{os.getpid()}", nvme=True)
    svc = Service(cfg, tmp_path)
    try:
        with server(cfg, "page_first", tmp_path, "nvme") as srv:
            cold = ask(srv)
            deadline = time.monotonic() + 30
            while svc.stats()["stored_blocks"] < 6 and time.monotonic() < deadline:
                time.sleep(0.2)
            # One-shot filler blocks (more than the DRAM tier holds) push every page
            # of the prompt down to NVMe (LRU, write-on-evict); then seal the regions.
            fill = np.zeros(PAGE_BYTES, dtype=np.uint8)
            for _ in range(24):
                svc.client.store([os.urandom(16)], [fill]).wait(60)
            assert svc.client.flush(60)
            # The test hook: overwrite the region log's first regions (the prompt's
            # pages went down first) behind the service's back.
            data = tmp_path / "nvme" / "ucm-regions.dat"
            with open(data, "r+b") as f:
                f.write(b"\xa5" * (48 << 20))
                f.flush()
                os.fsync(f.fileno())
            before = svc.stats()["corrupt"]
            srv.flush_cache()
            r = ask(srv)
            assert svc.stats()["corrupt"] > before
            assert r["details"].get("storage", 0) == 0, r  # nothing decoded from the bad pages
            assert_same(r, cold)
    finally:
        svc.close()
