"""Where a DRAM hit's time goes in vLLM, beside vLLM's own prefix-cache hit.

A probe, not a bench: one vLLM-for-CPU engine with UCMConnector wrapped so
that every connector call is timed (per call, in the process that makes
it), and three phases per document, each prompt asked alone with
max_tokens=1:

- cold: the document's first ask (computed; its blocks stored in ucm);
- ucm hit: vLLM's prefix cache reset first, so the prefix comes from ucm's
  DRAM tier (the connector copies it into vLLM's pages);
- APC hit: the same prompt again at once, so vLLM's own prefix cache holds it.

It prints, per phase, the median time to first token and the median time
spent inside each connector call during a request, so that the gap
between the ucm hit and the APC hit can be laid against the calls that
make it. Run from the repository root (the engine process imports this
file as `tools.dram_hit_probe`):

    PYTHONPATH=. .venv/bin/python tools/dram_hit_probe.py [--docs 4] [--doc-tokens 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from ucm.connectors.vllm import UCMConnector as _Base

CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "get_finished")
ENV_OUT = "DRAM_HIT_PROBE_OUT"  # not UCM_: those name config keys


def _timed(name: str):
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return getattr(super(UCMConnector, self), name)(*args, **kwargs)
        finally:
            self.spent[name] += time.perf_counter() - t0
            self.calls[name] += 1
            if name in ("get_finished", "update_connector_output"):  # once per step, in its own process
                self.flush()
    call.__name__ = name
    return call


class UCMConnector(_Base):
    """UCMConnector whose calls add their seconds to per-process totals,
    written (cumulative) to $DRAM_HIT_PROBE_OUT/<pid>.json once a step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.out = Path(os.environ[ENV_OUT]) / f"{os.getpid()}.json"

    def flush(self) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"spent": self.spent, "calls": self.calls}))
        tmp.replace(self.out)


for _name in CALLS:
    setattr(UCMConnector, _name, _timed(_name))


def totals(out_dir: Path) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and calls per connector call, summed over the engine's processes, now."""
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for f in out_dir.glob("*.json"):
        got = json.loads(f.read_text())
        for k, v in got["spent"].items():
            spent[k] += v
        for k, v in got["calls"].items():
            calls[k] += v
    return spent, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from ucm.apps.model import prepare

    model = str(prepare("smollm2"))
    work = Path(tempfile.mkdtemp(prefix="ucm-dram-probe-"))
    out_dir = work / "probe"
    out_dir.mkdir()
    os.environ[ENV_OUT] = str(out_dir)
    cfg = {"block_tokens": 128, "tiers": [{"adapter": "dram", "capacity": "1GiB"}], "landing_tier": "dram",
           "service": {"name": f"probe-{os.getpid()}", "socket": str(work / "ucm.sock"), "metrics_port": None}}
    (work / "ucm.yaml").write_text(json.dumps(cfg))
    kv = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="tools.dram_hit_probe",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"ucm_config": str(work / "ucm.yaml")})
    llm = LLM(model=model, max_model_len=a.doc_tokens + 256, enforce_eager=True, enable_prefix_caching=True,
              seed=0, kv_transfer_config=kv)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    import random

    rng = random.Random(0)
    samples: dict[str, list[float]] = defaultdict(list)
    per_call: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    steps: dict[str, list[int]] = defaultdict(list)  # engine steps a request took (build_connector_meta calls)
    cached: dict[str, list[int]] = defaultdict(list)
    firsts: dict[str, list[int]] = defaultdict(list)

    def ask(phase: str, prompt: list[int]) -> None:
        before, n0 = totals(out_dir)
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        samples[phase].append(time.perf_counter() - t0)
        time.sleep(0.05)  # the engine's last step file lands
        after, n1 = totals(out_dir)
        for k in CALLS:
            per_call[phase][k].append(after.get(k, 0.0) - before.get(k, 0.0))
        steps[phase].append(n1.get("build_connector_meta", 0) - n0.get("build_connector_meta", 0))
        cached[phase].append(int(o.num_cached_tokens or 0))
        firsts[phase].append(o.outputs[0].token_ids[0])

    for r in range(a.rounds):
        for d in range(a.docs):
            doc = [rng.randrange(1000, 40000) for _ in range(a.doc_tokens)]
            prompt = doc + [rng.randrange(1000, 40000) for _ in range(40)]
            ask("cold", prompt)
            llm.reset_prefix_cache()
            ask("ucm_hit", prompt)
            ask("apc_hit", prompt)
    res = {"doc_tokens": a.doc_tokens, "docs": a.docs, "rounds": a.rounds,
           "ttft_p50_s": {k: round(statistics.median(v), 4) for k, v in samples.items()},
           "cached_tokens_p50": {k: statistics.median(v) for k, v in cached.items()},
           "first_tokens_equal": firsts["ucm_hit"] == firsts["apc_hit"],
           "engine_steps_p50": {k: statistics.median(v) for k, v in steps.items()},
           "calls_p50_s": {ph: {k: round(statistics.median(v), 4) for k, v in calls.items() if max(v) > 0}
                           for ph, calls in per_call.items()}}
    print(json.dumps(res, indent=1))
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
