"""`python -m ucm.apps.demo` (`make demo`): what ucm gives a vLLM user that
vLLM's own prefix cache cannot.

vLLM for CPU serves the demo's model (`ucm.apps.model`) with its prefix
cache on and a KV space of about `--engine-kv-prompts` of the workload's
longest prompts (as on any busy GPU: the KV memory is smaller than the
working set), sized from the model's geometry (layers x 2 x KV heads x
head size x dtype bytes x 128-token pages). The workload
(`ucm.apps.demo.workload`) is several users interleaved: documents asked
about again and again, chats growing turn by turn, two shared system
prompts; the engine's own cache evicts what comes back. It runs three
times, each in a new engine process (`ucm.apps.demo.engine`):

1. vLLM alone (prefix cache on): the reference outputs;
2. vLLM + ucm: UCMConnector and a ucm service started by the demo, its
   DRAM tier about `--dram-fraction` of the working set, NVMe under a
   temporary directory; what the engine evicted comes back from ucm;
3. a restarted engine + ucm: a new engine process, the same service still
   running; the new engine finds the previous engine's blocks.

Prints the machine, TTFT p50/p90 per request class for each run, prompt
tokens by source (vLLM's prefix cache, ucm DRAM, ucm NVMe, computed) and
whether every output equals run 1's; writes a plot (`--plot`, default
out/demo_ttft.png) and, with `--json`, every row. `--quick` runs a reduced
demo (few short requests, a tiny KV space: the end-to-end test).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from ucm.apps.demo.engine import BLOCK_TOKENS, PROGRESS_FD
from ucm.apps.demo.report import machine_line, plot, summarize, table
from ucm.apps.demo.workload import QUICK, WorkloadSpec, build_workload, distinct_blocks
from ucm.apps.engine_env import with_ipc_dir
from ucm.apps.model import DTYPE_BYTES, page_bytes
from ucm.progress import bar, enabled

RUN_NAMES = ("vLLM alone", "vLLM + ucm", "restarted + ucm")


def service_config(base: Path, work: Path, dram_blocks: int, block_bytes: int, nvme_bytes: int) -> dict[str, Any]:
    """`base` (configs/default.yaml) resized for the demo: 128-token blocks,
    a DRAM tier of exactly `dram_blocks` blocks (one block per arena extent),
    NVMe of `nvme_bytes` and the KV events' descriptions under `work`, a
    private socket, no metrics port."""
    cfg = yaml.safe_load(base.read_text())
    cfg["block_tokens"] = BLOCK_TOKENS
    for tier in cfg["tiers"]:
        if tier["adapter"] == "dram":
            tier["capacity"] = dram_blocks * block_bytes
            tier["headroom"] = "15%"  # a small tier: room for a document staged back from NVMe
            tier.setdefault("options", {}).update({"prefault": False, "extent_bytes": block_bytes})
        elif tier["adapter"] == "nvme":
            tier["capacity"] = f"{nvme_bytes >> 20}MiB"
            tier.setdefault("options", {})["path"] = str(work / "nvme")
    if (cfg.get("events") or {}).get("path"):
        cfg["events"]["path"] = str(work / "catalog.log")
    cfg.setdefault("service", {})
    cfg["service"].update({"name": f"demo-{os.getpid()}", "socket": str(work / "ucm.sock"), "metrics_port": None})
    return cfg


ENGINE_EXIT_S = 120  # from the end of its reports to its exit


def _run_engine(spec: dict, work: Path, name: str, label: str, progress) -> dict:
    """Runs `ucm.apps.demo.engine` on `spec` in a new process, advancing
    `progress` (its step named `label`) as it reports; its output goes to a
    log in `work`."""
    spec_path, out_path, log_path = work / f"spec-{name}.json", work / f"out-{name}.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes with whole GiB
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    with_ipc_dir(env, work)  # vLLM's ZMQ IPC sockets, removed with `work`
    rfd, wfd = os.pipe()
    env[PROGRESS_FD] = str(wfd)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ucm.apps.demo.engine", str(spec_path), str(out_path)],
                                env=env, cwd=str(work), stdout=log, stderr=subprocess.STDOUT, pass_fds=(wfd,))
    os.close(wfd)
    try:
        buf = b""
        with os.fdopen(rfd, "rb", buffering=0) as pipe:
            while True:
                ready, _, _ = select.select([pipe], [], [], 1.0)
                if not ready:
                    if proc.poll() is not None:
                        break
                    continue
                chunk = pipe.read(4096)
                if not chunk:
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line == b"ready":
                        progress.set_postfix_str(f"{label}: replaying")
                    elif line.startswith(b"done "):
                        progress.update(1)
        rc = proc.wait(timeout=ENGINE_EXIT_S)
    finally:  # an interrupt or a hung engine: the engine process does not outlive the demo
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0 or not out_path.exists():
        text = log_path.read_text(errors="replace")
        causes = [ln for ln in text.splitlines() if "Error" in ln and "Traceback" not in ln][:8]
        raise RuntimeError(f"run {label!r} failed (exit {rc}); first errors:\n" + "\n".join(causes) +
                           f"\n... last lines of its log:\n{text[-3000:]}")
    return json.loads(out_path.read_text())


def _tier_counts(client) -> dict[str, Any]:
    """The service's block counts now ({} when it cannot answer: the figures
    are then missing from the report, nothing else)."""
    try:
        stats = client.stats()
    except Exception:
        return {}
    t = stats.get("tiers", {})
    return {"stored_blocks": stats.get("stored_blocks", 0), "loaded_blocks": stats.get("loaded_blocks", 0),
            **{f"{name}_{k}": v.get(k, 0) for name, v in t.items() for k in ("blocks", "demotions_in",
                                                                               "promotions_in")}}


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ucm.apps.demo.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a reduced demo: few short requests, a tiny KV space")
    ap.add_argument("--seed", type=int, default=19, help="seed of the workload (default 19)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32",
                    help="model and KV dtype (default float32: faster than bf16 with vLLM for CPU here, "
                         "and a hit's numerics equal a cold prefill's)")
    ap.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per request (default 8; quick 4)")
    ap.add_argument("--engine-kv-prompts", type=float, default=None,
                    help="vLLM's KV space in longest prompts of the workload (default 2.5; quick 1.5)")
    ap.add_argument("--dram-fraction", type=float, default=0.6,
                    help="ucm's DRAM tier as a fraction of the workload's distinct blocks (default 0.6)")
    ap.add_argument("--config", default=None, help="base YAML of the service (default: configs/default.yaml)")
    ap.add_argument("--plot", default="out/demo_ttft.png", help="PNG written here (default out/demo_ttft.png)")
    ap.add_argument("--json", default=None, help="also write every row and the summary to this JSON file")
    a = ap.parse_args(argv)
    if a.engine_kv_prompts is None:
        a.engine_kv_prompts = 1.5 if a.quick else 2.5
    if a.engine_kv_prompts < 1:
        ap.error(f"--engine-kv-prompts must be >= 1 (one prompt must fit), got {a.engine_kv_prompts}")
    if not 0 < a.dram_fraction <= 4:
        ap.error(f"--dram-fraction must be in (0, 4], got {a.dram_fraction}")
    if a.max_tokens is None:
        a.max_tokens = 4 if a.quick else 8
    if a.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {a.max_tokens}")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = _parse(argv)
    import ucm
    from ucm.apps.model import prepare

    say = print if not enabled() else (lambda *x: None)  # with a bar on the terminal, its postfix says it
    base = Path(a.config) if a.config else Path(__file__).resolve().parents[3] / "configs" / "default.yaml"
    if not base.is_file():
        print(f"ucm demo: no service config at {base}; pass --config configs/default.yaml of a clone",
              file=sys.stderr)
        return 2
    plot_path, json_path = Path(a.plot).resolve(), Path(a.json).resolve() if a.json else None
    machine = machine_line()
    print(f"machine: {machine}", flush=True)
    model = Path(prepare("smollm2"))
    from transformers import AutoTokenizer

    spec = QUICK if a.quick else WorkloadSpec()
    spec = dataclasses.replace(spec, seed=a.seed)
    requests = build_workload(AutoTokenizer.from_pretrained(str(model)), spec)
    classes = {r.index: r.cls for r in requests}
    longest = max(len(r.prompt) for r in requests)
    page = page_bytes(model, a.dtype, BLOCK_TOKENS)
    kv_pages = max(math.ceil(a.engine_kv_prompts * longest / BLOCK_TOKENS),
                   math.ceil((longest + a.max_tokens) / BLOCK_TOKENS) + 1)
    blocks = distinct_blocks(requests, BLOCK_TOKENS)
    dram_blocks = max(8, math.ceil(a.dram_fraction * blocks))  # 8: the fewest extents of an arena
    dram_bytes = dram_blocks * page
    nvme_bytes = max(512 << 20, (4 * blocks * page >> 20) << 20)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    print(f"workload: {len(requests)} requests from {spec.docs} documents asked {spec.asks} times and {spec.chats} "
          f"chats of {spec.turns} turns, interleaved (seed {spec.seed}); {prompt_tokens:,} prompt tokens, "
          f"{blocks} distinct {BLOCK_TOKENS}-token blocks ({blocks * page / (1 << 20):,.0f} MiB of {a.dtype} KV)")
    print(f"vLLM: prefix cache on, KV space {kv_pages} pages = {kv_pages * BLOCK_TOKENS:,} tokens "
          f"({kv_pages * page / (1 << 20):,.0f} MiB, {kv_pages * BLOCK_TOKENS / longest:.1f}x the longest prompt); "
          f"ucm: DRAM {dram_blocks} blocks = {dram_bytes >> 20} MiB ({dram_blocks / blocks:.0%} of the working set), "
          f"NVMe in a temporary directory; {a.max_tokens} greedy tokens per request", flush=True)
    engine = {"model": str(model), "dtype": a.dtype, "kv_bytes": kv_pages * page, "max_tokens": a.max_tokens,
              "max_model_len": min(kv_pages * BLOCK_TOKENS, longest + a.max_tokens + 16),
              "requests": [r.to_json() for r in requests]}
    work = Path(tempfile.mkdtemp(prefix="ucm-demo-"))
    (work / "nvme").mkdir()
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(service_config(base, work, dram_blocks, page, nvme_bytes)))
    runs: list[dict[str, Any]] = []
    service: list[dict[str, Any]] = []
    cwd, client = os.getcwd(), None
    t0 = time.monotonic()
    os.chdir(work)  # processes are spawned here, away from a source checkout
    try:
        with bar(total=len(RUN_NAMES) * len(requests), desc="ucm demo", unit="req") as progress:
            for i, name in enumerate(RUN_NAMES):
                run_spec = dict(engine)
                if i > 0:
                    if client is None:
                        progress.set_postfix_str("starting the ucm service")
                        client = ucm.connect(str(cfg_path))  # the service outlives the engines
                        if not client.connected:
                            raise RuntimeError("the ucm service did not start")
                    run_spec["ucm_config"] = str(cfg_path)
                say(f"ucm demo: run {i + 1}/{len(RUN_NAMES)}: {name} (a new engine process) ...")
                progress.set_postfix_str(f"{name}: starting the engine")
                result = _run_engine(run_spec, work, f"run{i + 1}", name, progress)
                runs.append({"name": name, **result})
                if client is not None:
                    service.append(_tier_counts(client))
    except (RuntimeError, OSError) as e:
        print(f"ucm demo: {e}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - t0
    summary = summarize(runs, classes)
    print()
    print(table(summary))
    s2, s3 = service[0], service[-1]
    print(f"\nucm service after run 2: {s2.get('stored_blocks', '?')} blocks stored, "
          f"{s2.get('nvme_demotions_in', '?')} demoted to NVMe; after run 3: {s3.get('loaded_blocks', '?')} "
          f"loaded in all, "
          f"{s3.get('dram_promotions_in', '?')} staged back from NVMe. Engines started in "
          + ", ".join(f"{r['engine_start_s']:.0f}" for r in runs) + f" s; the runs took {elapsed:.0f} s.")
    unequal = [(s["name"], s["unequal"]) for s in summary["runs"][1:] if s["unequal"]]
    if unequal:
        print("outputs NOT equal to run 1 for requests: " + "; ".join(f"{n}: {u}" for n, u in unequal))
    title = (f"ucm demo: SmolLM2-135M on vLLM for CPU, prefix cache on, KV space {kv_pages * BLOCK_TOKENS:,} "
             f"tokens; {len(requests)} interleaved requests\n{machine}")
    note = plot(runs, classes, summary, plot_path, title)
    print(f"\n{note}" if note else f"\nplot written to {plot_path}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({
            "machine": machine, "workload": {**dataclasses.asdict(spec),
                                             "requests": len(requests), "prompt_tokens": prompt_tokens,
                                             "distinct_blocks": blocks},
            "engine_kv_pages": kv_pages, "dram_bytes": dram_bytes, "dtype": a.dtype, "max_tokens": a.max_tokens,
            "classes": {str(k): v for k, v in classes.items()}, "summary": summary, "service": service,
            "runs": runs}, indent=1))
    return 0 if not unequal else 3


if __name__ == "__main__":
    sys.exit(main())
