"""`ucm bench sglang`: time to first token in SGLang (CPU) with ucm as its
HiCache storage backend, against SGLang's own device-cache hit, in one run.

Workload: `--docs` documents of `--doc-tokens` deterministic pseudo-random
token ids, each asked twice (pass 1 the document and one question, pass 2
the document and another), max_new_tokens=1 (TTFT = the request's wall
time), greedy, one request at a time, the model of `--model`, pages of
`PAGE` tokens (pass 2 reuses the document's full pages). One SGLang server with
`--enable-hierarchical-cache` and ucm as its storage (`page_first`, write
through, prefetch `wait_complete`); one `ucm serve` (DRAM + NVMe, LRU) for
the whole run. Per document:

- cold: pass 1 (a full prefill; its pages are written through to ucm);
- device hit (the control): pass 2 once unmeasured (it stores pass 2's own
  pages, as the ucm hits reuse them), then, once ucm's stored-block counter
  has stopped moving and the service has flushed (no write-through backup
  in flight), pass 2 again: SGLang's radix cache on the device holds the
  same pages the ucm hits reuse (`*_cached` shows the tokens);
- ucm DRAM hit: `/flush_cache` (device and host tiers emptied), pass 2:
  the document's pages come from ucm's DRAM arena;
- ucm NVMe-only hit: one-shot filler blocks push the document's pages
  below DRAM, checked with `locate` on their ucm keys (more filler until
  none is left in DRAM, at most 4 rounds; `tiers_of_doc_pages` reports
  what was found), `/flush_cache`, pass 2: staged NVMe -> DRAM by the
  service, then copied into SGLang's host pool;
- after a server restart (a fresh SGLang process on the same ucm service):
  pass 2 again, served from ucm.

Each hit is asked `--repeat` times (fresh flush each time; the NVMe rounds
push the pages down again); `*_ttft_s` are medians over documents x rounds.
`outputs_equal`: every hit's first token equals the cold run's answer to
the same prompt computed on the device (the device-hit run).
`copy`: the host pool <-> arena copy through `UCMStorage.batch_set_v1` /
`batch_get_v1` (SGLang's real MHATokenToKVPoolHost, page_first, the
document's pages) against one `memcpy` of the same bytes (`_native.copy`),
6 rounds interleaved, the best and the median round: the whole calls
(`set_over_memcpy`, `get_over_memcpy`, with the service's round trips)
and the copy proper inside them (`set_copy_over_memcpy`, ...), measured
before the engine runs (DRAM has room). `copy_after_run`: the
same at the end, in the DRAM the run filled, where a store also waits for
its victims' demotion to NVMe.

On CPU the server needs SGLang's HiCache CPU shim of the test tree
(`--cpu-shim`, default tests/sglang_cpu of this checkout): SGLang binds its
device<->host copies only for CUDA/HIP/XPU. Runs in SGLang's venv
(`.venv-sglang/bin/ucm bench sglang`)."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ucm.bench import common
from ucm.bench.blocks import tier_counts
from ucm.progress import bar

PAGE = 64
MODEL_ID = "ucm-bench-sglang"  # the server's ucm_model_id: the bench can name the pages' ucm keys
QUESTIONS = ((1, 3000, 17), (2, 3100, 23))  # pseudo-random question tails of 17 and 23 tokens


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "sglang", help="TTFT in SGLang: cold, device hit, ucm DRAM / NVMe hits, restart",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_counts(p, docs=(2, "documents"), doc_tokens=(3000, "tokens per document"),
                      repeat=(2, "rounds of every hit measurement"))
    common.add_model_flag(p)
    p.add_argument("--cpu-shim", default=None, help="directory with SGLang's HiCache CPU shim (default: "
                   "tests/sglang_cpu of this checkout)")
    common.add_json_flag(p)


def _tokens(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(100, 40000) for _ in range(n)]


def _prompts(docs: int, doc_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    pass1, pass2 = [], []
    for d in range(docs):
        doc = _tokens(1000 + d, doc_tokens)
        (s1, _, n1), (s2, _, n2) = QUESTIONS
        pass1.append(doc + _tokens(s1 * 7 + d, n1))
        pass2.append(doc + _tokens(s2 * 7 + d, n2))
    return pass1, pass2


def _median(xs: list[float]) -> Optional[float]:
    return round(statistics.median(xs), 4) if xs else None


def _copy_bench(pages: int, cfg: str, tag: str, rounds: int = 6) -> dict:
    """batch_set_v1 / batch_get_v1 of `pages` pages against one memcpy of
    the same bytes into memory already touched, interleaved per round;
    `tag` (one character) keeps each call's page keys its own. Besides the
    whole calls (`set_*`, `get_*`: the service's reserve/commit or
    acquire/release round trips included), `*_copy_*` is the copy proper:
    the time spent in the copier between the host pool and the arena."""
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    from ucm import _native
    from ucm.connectors.sglang import UCMStorage

    tokens = pages * PAGE
    kv = MHATokenToKVPool(tokens * 2, PAGE, torch.bfloat16, 3, 64, 30, device="cpu", enable_memory_saver=False,
                          start_layer=0, end_layer=30)
    host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=0, end_layer=30,
                                write_back_staging=kv.hicache_write_back_staging)
    sc = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                              model_name="copy-bench", extra_config={"interface_v1": 1, "ucm_config": cfg,
                                                                     "ucm_model_id": "copy-bench"})
    backend = UCMStorage(sc, {})
    backend.register_mem_pool_host(host)
    idx = host.alloc(tokens)
    host.kv_buffer.view(-1).view(torch.int16).random_(-1000, 1000)
    copier = backend.copier
    nbytes = pages * copier.page_bytes
    a, b = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    _native.copy(b, a)  # the baseline's destination touched, as the arena's slots are
    out: dict[str, list[float]] = {k: [] for k in ("set_s", "set_copy_s", "get_s", "get_copy_s", "memcpy_s")}
    try:
        for r in range(rounds):
            keys = [f"{tag}{r:03d}{i:060d}" for i in range(pages)]
            for name, call in (("set", backend.batch_set_v1), ("get", backend.batch_get_v1)):
                spent = copier.copy_seconds
                t = time.perf_counter()
                ok = call(keys, idx)
                out[f"{name}_s"].append(time.perf_counter() - t)
                out[f"{name}_copy_s"].append(copier.copy_seconds - spent)
                if not all(ok):
                    return {"error": f"a copy round did not {name} every page"}
            t = time.perf_counter()
            _native.copy(b, a)
            out["memcpy_s"].append(time.perf_counter() - t)
    finally:
        backend.close()
    res: dict[str, Any] = {"pages": pages, "bytes": nbytes, "rounds": rounds}
    for stat, f in (("median", statistics.median), ("best", min)):
        v = {k: f(x) for k, x in out.items()}
        res[stat] = {**{k.replace("_s", "_gb_s"): round(nbytes / x / 1e9, 2) for k, x in v.items()},
                     **{f"{k[:-2]}_over_memcpy": round(v["memcpy_s"] / x, 3) for k, x in v.items() if k != "memcpy_s"}}
    # The headline (as before): best of the rounds, whole calls.
    res["set_over_memcpy"], res["get_over_memcpy"] = res["best"]["set_over_memcpy"], res["best"]["get_over_memcpy"]
    return res


def _doc_keys(prompts: list[list[int]]) -> list[bytes]:
    """The ucm keys of the full pages of `prompts` as the bench's server
    names them (ucm_model_id MODEL_ID, the default model's bf16 page_first
    pool of 30 layers x 3 KV heads x 64, TP/PP 1, no cache salt)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    from ucm.connectors.sglang.namespace import PoolGeometry, build_namespace, page_keys

    seed = build_namespace(PoolGeometry("bfloat16", 30, 3, 64, PAGE, "page_first"), MODEL_ID).digest()
    out: list[bytes] = []
    for p in prompts:
        full = len(p) // PAGE * PAGE
        out.extend(page_keys(seed, get_hash_str(p[:full], None, page_size=PAGE)))
    return out


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import yaml

    import ucm
    from ucm.apps.model import prepare
    from ucm.bench.engines.sglang_server import SGLangServer, hicache_args

    shim = Path(args.cpu_shim or Path(__file__).resolve().parents[3] / "tests" / "sglang_cpu")
    if not (shim / "sitecustomize.py").is_file():
        print(f"ucm bench sglang: no SGLang CPU shim at {shim} (--cpu-shim)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(shim))
    import stand_ins  # the import-only stand-ins SGLang needs in this process too

    stand_ins.install()
    model = str(prepare(args.model))
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-sglang-"))
    (work / "nvme").mkdir()
    page_bytes = 30 * 3 * 64 * 2 * 2 * PAGE
    doc_pages = args.doc_tokens // PAGE
    copy_rounds = 6
    # The documents' pages with room, and the copy bench's pages beside them (no demotion during the run).
    dram_bytes = max(64 << 20, 4 * args.docs * (doc_pages + 1) * page_bytes) + copy_rounds * doc_pages * page_bytes
    cfg = {"block_tokens": PAGE,
           "tiers": [{"adapter": "dram", "capacity": f"{dram_bytes >> 20}MiB", "headroom": 0.2,
                      "options": {"prefault": True}},  # as configs/default.yaml: copies into the arena take no faults
                     {"adapter": "nvme", "capacity": f"{max(1024, 4 * dram_bytes >> 20)}MiB",
                      "options": {"path": str(work / "nvme"), "region_size": "16MiB"}}],
           "policy": {"name": "lru"},
           "service": {"name": f"bench-sglang-{os.getpid()}", "socket": str(work / "ucm.sock")}}
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    service = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", str(cfg_path)], cwd=str(work),
                               stdout=open(work / "serve.log", "ab"), stderr=subprocess.STDOUT)
    client = ucm.connect(str(cfg_path), start=False)
    deadline = time.monotonic() + 60
    while not client.try_connect() and time.monotonic() < deadline:
        time.sleep(0.1)
    pass1, pass2 = _prompts(args.docs, args.doc_tokens)
    flags = hicache_args(str(cfg_path), "page_first", PAGE, {"ucm_model_id": MODEL_ID}) + [
        "--max-total-tokens", str(max(16384, 2 * (args.doc_tokens + 64)))]

    def server(tag: str) -> SGLangServer:
        return SGLangServer(sys.executable, model, flags, pythonpath=[str(shim)], log_path=str(work / f"{tag}.log"))

    def ask(srv: SGLangServer, prompt: list[int]) -> dict:
        r = srv.generate(prompt, 1)
        m = r["meta_info"]
        return {"ttft_s": r["ttft_s"], "id": r["output_ids"][0], "details": m.get("cached_tokens_details") or {}}

    doc_keys = _doc_keys(pass2)

    def settle(timeout: float = 60.0) -> None:
        """Until ucm's stored-block counter stops moving and the service has
        flushed: no write-through backup of SGLang's is in flight."""
        last, still, end = None, 0, time.monotonic() + timeout
        while still < 3 and time.monotonic() < end:
            n = client.stats().get("stored_blocks")
            still = still + 1 if n == last else 0
            last = n
            time.sleep(0.3)
        client.flush(60)

    def tiers_of_doc() -> dict:
        return tier_counts(client.locate(doc_keys))

    def to_nvme() -> dict:
        fill = np.zeros(page_bytes, dtype=np.uint8)
        rounds, found = 0, tiers_of_doc()
        while rounds < 4 and (rounds == 0 or found.get("dram", 0)):
            for _ in range(dram_bytes // page_bytes + 8):
                client.store([os.urandom(16)], [fill]).wait(60)
            client.flush(60)
            rounds += 1
            found = tiers_of_doc()
        return {"filler_rounds": rounds, "tiers_of_doc_pages": found}

    res: dict[str, Any] = {"docs": args.docs, "doc_tokens": args.doc_tokens, "page_size": PAGE,
                           "reused_tokens_per_doc": len(pass2[0]) // PAGE * PAGE, "repeat": args.repeat}
    samples: dict[str, list] = {k: [] for k in ("cold", "device_hit", "ucm_dram_hit", "ucm_nvme_hit",
                                                "ucm_after_restart")}
    equal = True
    phases = bar(total=5, desc="bench sglang", unit="phase")
    try:
        res["copy"] = _copy_bench(doc_pages, str(cfg_path), "a", copy_rounds)  # DRAM has room: the copy itself
        with server("a") as srv:
            phases.set_postfix_str("cold and device hits")
            srv.generate(_tokens(9, 64), 1)  # one-time costs of the first forward
            device_ids = []
            for p1, p2 in zip(pass1, pass2):
                samples["cold"].append(ask(srv, p1))
                first = ask(srv, p2)  # stores pass 2's own pages (device and ucm)
                settle()
                r = ask(srv, p2)
                samples["device_hit"].append(r)
                device_ids.append(r["id"])
                equal &= first["id"] == r["id"]
            res["tiers_of_doc_pages_after_cold"] = tiers_of_doc()
            phases.update(1)

            def storage_hits(kind: str) -> None:
                """pass 2 again with SGLang's device cache flushed: served by ucm."""
                nonlocal equal
                for i, p2 in enumerate(pass2):
                    srv.flush_cache()
                    r = ask(srv, p2)
                    samples[kind].append(r)
                    equal &= r["id"] == device_ids[i]

            phases.set_postfix_str("ucm DRAM hits")
            for _ in range(args.repeat):
                storage_hits("ucm_dram_hit")
            phases.update(1)
            phases.set_postfix_str("ucm NVMe hits")
            res["nvme_push"] = []
            for _ in range(args.repeat):
                settle()
                res["nvme_push"].append(to_nvme())
                storage_hits("ucm_nvme_hit")
            phases.update(1)
        phases.set_postfix_str("fresh server")
        with server("b") as srv:
            srv.generate(_tokens(9, 64), 1)
            for i, p2 in enumerate(pass2):
                r = ask(srv, p2)
                samples["ucm_after_restart"].append(r)
                equal &= r["id"] == device_ids[i]
        phases.update(1)
        phases.set_postfix_str("copy set / get")
        res["copy_after_run"] = _copy_bench(doc_pages, str(cfg_path), "b", copy_rounds)
        phases.update(1)
        res["ucm_stats"] = {k: client.stats().get(k) for k in ("stored_blocks", "loaded_blocks", "corrupt")}
    finally:
        phases.close()
        client.close()
        service.terminate()
        service.wait(30)
        shutil.rmtree(work / "nvme", ignore_errors=True)  # its region files; the logs stay beside it
    for k, v in samples.items():
        res[f"{k}_ttft_s"] = _median([s["ttft_s"] for s in v])
        res[f"{k}_cached"] = [s["details"] for s in v]
    dev = res["device_hit_ttft_s"]
    res["ucm_dram_hit_over_device_hit"] = round(res["ucm_dram_hit_ttft_s"] / dev, 3)
    res["ucm_nvme_hit_over_device_hit"] = round(res["ucm_nvme_hit_ttft_s"] / dev, 3)
    res["cold_over_ucm_dram_hit"] = round(res["cold_ttft_s"] / res["ucm_dram_hit_ttft_s"], 3)
    res["outputs_equal"] = bool(equal)
    res["sglang_version"] = _sglang_version()
    print(json.dumps(res, indent=None if args.json else 2))
    return 0


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")
