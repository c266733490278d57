"""End to end: UCMConnector inside vLLM for CPU with SmolLM2-135M-Instruct.

One driver process (this file run as a script) creates two vLLM engines,
one after the other, on the same prompts, while it holds a client of a
private ucm service:

- reference: no connector, vLLM prefix caching on: P1 cold, then P1 and P2
  again as prefix-cache hits (P2 shares P1's first 256 tokens);
- then one engine with the connector for every run below; vLLM's own
  prefix cache is emptied before each run (`reset_prefix_cache`), so a hit
  can only come from ucm (the blocks the service served are counted), and
  each run sets its load path and prefetch policy per request
  (`kv_transfer_params`);
- ucm cold: P1 misses, its blocks are saved;
- ucm hit: P1 and P2
  load 256 tokens from ucm; their greedy tokens must equal vLLM's own
  prefix-cache-hit outputs with the same number of cached tokens (the
  numerics of "suffix on a cached prefix" may differ from a cold prefill,
  for vLLM's prefix cache too);
- ucm nvme: the driver stores filler blocks until P1's blocks are demoted
  from DRAM to NVMe (LRU policy, DRAM of five blocks); the engine then finds
  them below DRAM and streams them layer by layer under the forward
  (the engine's `ucm_load_streaming` auto), then once more with the
  request's `ucm_load_streaming` off (the asynchronous path);
- prefetch: the same again for each request `ucm_prefetch_policy`
  (wait_complete, timeout, best_effort): the scheduler stages first, then
  loads from DRAM.

A second driver, tests/e2e/test_vllm_robustness.py, checks partial hits,
concurrent requests and a standalone service killed and restarted under
the engine. The worker side alone, on fake KV tensors, is
tested in tests/unit/connectors/. Both drivers are skipped when vLLM or the
model package is not installed. The engines run in E2E_DTYPE (float32
unless UCM_E2E_DTYPE says otherwise, see vllm_support.py) with
VLLM_CPU_KVCACHE_SPACE=1 and VLLM_CPU_OMP_THREADS_BIND=0-1.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
from vllm_support import DTYPE_BYTES, E2E_DTYPE, close_engine, driver_main, run_driver, scaled_mib  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
MAX_TOKENS = 16
BLOCK_TOKENS = 128
BLOCK_BYTES = 30 * 2 * 3 * 64 * DTYPE_BYTES * BLOCK_TOKENS  # SmolLM2: layers x (K, V) x KV heads x head size

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


def _model_id(model: str) -> str:
    """The model part of the namespace UCMConnector gives this model's blocks
    (a fingerprint of its weights, not its path)."""
    from vllm.config import ModelConfig

    from ucm.connectors.vllm.namespace import model_identity

    return model_identity(ModelConfig(model=model, dtype=E2E_DTYPE, skip_tokenizer_init=True))


@pytest.mark.timeout(1500)
def test_ucm_connector_matches_vllm_prefix_cache(tmp_path):
    r = run_driver(HERE, tmp_path, 1400)
    ref, cold, hit, nvme = r["reference"], r["ucm_cold"], r["ucm_hit"], r["ucm_nvme"]
    # vLLM's own prefix cache served 256 tokens of each prompt in the reference run.
    assert ref["p1_hit"]["cached"] == 256 and ref["p2_hit"]["cached"] == 256
    # Cold run with the connector: nothing cached anywhere, same tokens as without it.
    assert cold["p1"]["cached"] == 0 and cold["p1"]["loaded"] == 0
    assert cold["p1"]["tokens"] == ref["p1_cold"]["tokens"]
    # vLLM's prefix cache emptied: the 256 tokens come from ucm (its two
    # blocks served by the service), and the output equals vLLM's own
    # prefix-cache hit token for token.
    assert hit["p1"]["cached"] == 256 and hit["p2"]["cached"] == 256
    assert hit["p1"]["loaded"] == 2 and hit["p2"]["loaded"] == 2
    assert hit["p1"]["tokens"] == ref["p1_hit"]["tokens"]
    assert hit["p2"]["tokens"] == ref["p2_hit"]["tokens"]
    # The same blocks, now only on NVMe: streamed layer by layer under the
    # forward (ucm_load_streaming auto), same tokens.
    assert nvme["p1"]["cached"] == 256 and nvme["p1"]["loaded"] == 2
    assert nvme["p1"]["tokens"] == ref["p1_hit"]["tokens"]
    assert r["p1_tiers"] == ["nvme", "nvme"]  # so the connector streamed them
    assert r["streamed"] == 2  # both blocks came through the streamed path
    assert r["promoted_after"] - r["promoted_before"] >= 2  # staged NVMe -> DRAM
    # Streaming off: the asynchronous whole-block load, same tokens.
    assert r["ucm_nvme_async"]["tiers_before"] == ["nvme", "nvme"]
    assert r["ucm_nvme_async"]["p1"]["cached"] == 256 and r["ucm_nvme_async"]["p1"]["loaded"] == 2
    assert r["ucm_nvme_async"]["p1"]["tokens"] == ref["p1_hit"]["tokens"]
    assert r["streamed_off"] == 0
    # The prefetch policies (ucm_prefetch_policy): P1 on NVMe only each time;
    # wait_complete stages it and loads all 256 tokens from DRAM; timeout
    # loads what reached DRAM in time; best_effort answers at once with what
    # is in DRAM (nothing). Each equals vLLM's own run with that cached length.
    by_cached = {256: ref["p1_hit"]["tokens"], 0: ref["p1_cold"]["tokens"]}
    for policy in ("wait_complete", "timeout", "best_effort"):
        got = r[f"prefetch_{policy}"]
        assert got["tiers_before"] == ["nvme", "nvme"], policy
        assert got["p1"]["tokens"] == by_cached[got["p1"]["cached"]], policy
        assert got["p1"]["loaded"] == got["p1"]["cached"] // BLOCK_TOKENS, policy
    assert r["prefetch_wait_complete"]["p1"]["cached"] == 256
    assert r["prefetch_best_effort"]["p1"]["cached"] == 0
    assert r["service"]["loaded_blocks"] >= 6
    # Every finished request told the service how long its answer was (a
    # placement hint): 1 cold + 2 hit + 1 NVMe-hit request at least.
    assert r["service"]["finished_requests"] >= 4


@pytest.mark.timeout(1500)
def test_a_lossless_nvme_hit_matches_vllm_prefix_cache(tmp_path):
    """With `lossless` on the NVMe tier, P1's blocks go to NVMe as frames
    (byte planes + zstd) and come back bit-exact: vLLM's greedy output after
    the NVMe-only hit equals its own prefix-cache hit token for token."""
    r = run_driver(HERE, tmp_path, 1400, "--codec", "lossless")
    assert r["p1_tiers"] == ["nvme", "nvme"]
    assert r["ucm_nvme"]["p1"]["cached"] == 256 and r["ucm_nvme"]["p1"]["loaded"] == 2
    assert r["ucm_nvme"]["p1"]["tokens"] == r["reference"]["p1_hit"]["tokens"]
    s = r["nvme_adapter"]
    assert s["codec"] == "lossless" and s["codec_decoded_blocks"] >= 2 and s.get("codec_fallback", 0) == 0
    assert s["codec_raw_bytes_in"] > s["codec_stored_bytes_out"]


# ---- the driver (runs in its own process; vLLM needs the __main__ guard) ------
def _prompts(tokenizer) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    p1 = ids[:300]
    if len(p1) < 300:
        raise SystemExit(f"prompt text too short: {len(ids)} tokens")
    tail = tokenizer.encode(" Summarise this in one sentence.", add_special_tokens=False)
    p2 = ids[:256] + tail + ids[256:270]
    return p1, p2


def _run(llm, prompt: list[int], **params) -> dict:
    """Greedy tokens of `prompt`; `params`: its kv_transfer_params (the
    connector's per-request settings)."""
    return _run_many(llm, [prompt], **params)[0]


def _run_many(llm, prompts: list[list[int]], **params) -> list[dict]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
             "text": o.outputs[0].text} for o in outs]


def _empty_prefix_cache(llm, timeout_s: float = 60.0) -> None:
    """Empties vLLM's own prefix cache. vLLM refuses while pages are held,
    and the connector holds a finished request's pages until its saves are
    reported, which happens in an engine step: a one-token request of three
    tokens (no full block, so nothing for ucm) makes that step."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be emptied")
        _run(llm, [1, 2, 3])
        time.sleep(0.05)


def _engine(model: str, ucm_config: str | None, prefix_caching: bool):
    """An engine, with UCMConnector when `ucm_config` is given (streaming
    "auto", no prefetch policy: the runs set theirs per request)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if ucm_config is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"ucm_config": ucm_config, "ucm_load_mode": "auto",
                                       "ucm_prefetch_policy": "off", "ucm_load_streaming": "auto"})
    return LLM(model=model, dtype=E2E_DTYPE, max_model_len=1024, enforce_eager=True,
               enable_prefix_caching=prefix_caching, seed=0, **kw)


def _driver(out: Path, work: Path, codec: str = "none") -> int:
    import yaml

    import ucm
    from ucm.apps.model import prepare

    model = str(prepare("smollm2"))
    cfg = {
        "block_tokens": BLOCK_TOKENS,
        "tiers": [
            {"adapter": "dram", "capacity": scaled_mib(16), "options": {"path": "/dev/shm", "prefault": False}},
            {"adapter": "nvme", "capacity": scaled_mib(512), "codec": codec,
             "options": {"path": str(work / "nvme"), "region_size": scaled_mib(8), "direct_io": False}},
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
        close_engine(llm)
        # One engine with the connector for every ucm run: its own prefix
        # cache is emptied before each (so the hit can only come from ucm),
        # and the load path and prefetch policy of a run are set per request
        # (kv_transfer_params). `loaded` counts the blocks the service served.
        llm = _engine(model, str(cfg_path), prefix_caching=True)

        def ucm_run(prompt: list[int], **params) -> dict:
            _empty_prefix_cache(llm)
            before = client.stats()["loaded_blocks"]
            got = _run(llm, prompt, **params)
            return {**got, "loaded": client.stats()["loaded_blocks"] - before}

        result["ucm_cold"] = {"p1": ucm_run(p1)}
        result["ucm_hit"] = {"p1": ucm_run(p1), "p2": ucm_run(p2)}
        # Push P1's blocks out of DRAM: store one-shot filler blocks of the same size.
        import torch

        from ucm.keys import Namespace, block_keys

        ns = Namespace(model=_model_id(model), kv_dtype=E2E_DTYPE, num_layers=30, num_kv_heads=3, head_size=64,
                       block_tokens=BLOCK_TOKENS, layout="vllm-cpu-page128")  # as UCMConnector names them
        fill = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)

        def push_p1_below_dram() -> list:
            for i in range(8):
                client.store([os.urandom(16)], [fill]).wait(30)
            return client.locate(block_keys(ns, p1))

        result["p1_tiers"] = push_p1_below_dram()
        result["promoted_before"] = client.stats()["tiers"]["dram"]["promotions_in"]
        streamed_before = client.stats().get("streamed_blocks", 0)
        result["ucm_nvme"] = {"p1": ucm_run(p1)}  # the engine's ucm_load_streaming auto: streamed
        result["promoted_after"] = client.stats()["tiers"]["dram"]["promotions_in"]
        result["streamed"] = client.stats().get("streamed_blocks", 0) - streamed_before
        # The same on NVMe only again, with streaming off: the asynchronous load.
        tiers = push_p1_below_dram()
        result["ucm_nvme_async"] = {"p1": ucm_run(p1, ucm_load_streaming="off"), "tiers_before": tiers}
        result["streamed_off"] = client.stats().get("streamed_blocks", 0) - streamed_before - result["streamed"]
        # Each prefetch policy: P1 pushed back to NVMe only, then the scheduler
        # stages it before loading it from DRAM (or answers without it).
        for policy in ("wait_complete", "timeout", "best_effort") if codec == "none" else ():  # codec runs: CI time
            tiers = push_p1_below_dram()
            result[f"prefetch_{policy}"] = {"p1": ucm_run(p1, ucm_prefetch_policy=policy), "tiers_before": tiers}
        close_engine(llm)
        result["service"] = {k: v for k, v in client.stats().items() if not isinstance(v, dict)}
        result["nvme_adapter"] = client.stats()["tiers"]["nvme"]["adapter"]
    finally:
        client.close()
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    driver_main(_driver, codec=("none", "the NVMe tier's codec (tiers[].codec)"))
