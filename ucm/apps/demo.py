"""`python -m ucm.apps.demo`: a multi-turn chat replayed through vLLM, without and with ucm.

Starts a ucm service from `configs/default.yaml` resized for a demo (DRAM
2GiB, NVMe under a temporary directory, 128-token blocks, no metrics port),
then replays `--conversations` chats of `--turns` turns each, turn by turn
across the chats (turn 1 of every chat, then turn 2, ...), as vLLM would see
them from a chat front end: every turn's prompt is the whole history so far
plus the new user message, in the model's chat template; the assistant
replies of the history are scripted, so both runs see the same prompts.
Each turn generates `--max-tokens` greedy tokens.

The replay runs twice, each in a fresh engine in its own subprocess (vLLM
prefix caching off in both, so every reused token comes from ucm):
- without ucm: plain vLLM, every turn prefills its whole history;
- with ucm: UCMConnector; a turn loads its history's full blocks from ucm.

Prints per turn the time to first token (vLLM's own per-request
first-token latency) without and with ucm, the tokens ucm served, whether
the outputs were equal, and the service's hits per tier; writes a plot to
`--plot` (default out/demo_ttft.png; needs matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

BLOCK_TOKENS = 128
SYSTEM = "You are a helpful, concise assistant."
TOPICS = [
    ("the water cycle", ["evaporation", "condensation", "precipitation", "groundwater"]),
    ("how a bicycle gear system works", ["chainrings", "cassette", "derailleur", "gear ratios"]),
    ("the history of the printing press", ["Gutenberg", "movable type", "paper", "literacy"]),
    ("baking sourdough bread", ["starter", "hydration", "proofing", "scoring"]),
    ("how vaccines train the immune system", ["antigens", "antibodies", "memory cells", "boosters"]),
]


def _conversations(n_conv: int, turns: int) -> list[list[tuple[str, str]]]:
    """Scripted (user, assistant) pairs per conversation; long-ish replies so
    the history grows by several hundred tokens per turn."""
    convs = []
    for c in range(n_conv):
        topic, parts = TOPICS[c % len(TOPICS)]
        conv = []
        for t in range(turns):
            part = parts[t % len(parts)]
            user = (f"Turn {t + 1}. I am learning about {topic}. Please explain {part} in detail, "
                    f"how it relates to what we discussed, and give one everyday example.")
            reply = " ".join(
                f"Regarding {part} in {topic}: point {k + 1} is that it connects to the earlier steps, "
                f"matters for the overall process, and can be observed in daily life in simple ways."
                for k in range(3))
            conv.append((user, reply))
        convs.append(conv)
    return convs


def _turn_prompts(tokenizer, convs: list[list[tuple[str, str]]]) -> list[tuple[int, int, list[int]]]:
    """(conversation, turn, prompt token ids), turn-major order."""
    out = []
    turns = len(convs[0])
    for t in range(turns):
        for c, conv in enumerate(convs):
            msgs = [{"role": "system", "content": SYSTEM}]
            for user, reply in conv[:t]:
                msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            msgs.append({"role": "user", "content": conv[t][0]})
            ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            out.append((c, t, [int(i) for i in ids]))
    return out


# ---- one replay in one engine (subprocess) -------------------------------------
def _replay(spec: dict) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("ucm_config"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"ucm_config": spec["ucm_config"]})
    prompts = spec["prompts"]
    max_len = max(len(p[2]) for p in prompts) + spec["max_tokens"] + 64
    llm = LLM(model=spec["model"], max_model_len=max_len, enforce_eager=True, enable_prefix_caching=False,
              seed=0, disable_log_stats=False, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1000, 1100))}], SamplingParams(max_tokens=1), use_tqdm=False)
    rows = []
    for c, t, ids in prompts:
        t0 = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = getattr(o, "metrics", None)
        ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        rows.append({"conv": c, "turn": t, "prompt_tokens": len(ids), "ttft_s": ttft or None, "wall_s": wall,
                     "cached": int(o.num_cached_tokens or 0), "tokens": list(o.outputs[0].token_ids)})
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return rows


def _subprocess(spec: dict, work: Path, name: str) -> list[dict]:
    spec_path, out_path = work / f"spec-{name}.json", work / f"out-{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    proc = subprocess.run([sys.executable, "-m", "ucm.apps.demo", "--run-config", str(spec_path), str(out_path)],
                          env=env, cwd=str(work), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"replay {name!r} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out_path.read_text())


def _demo_config(base: Path, work: Path, dram: str) -> dict:
    cfg = yaml.safe_load(base.read_text())
    cfg["block_tokens"] = BLOCK_TOKENS
    for tier in cfg["tiers"]:
        if tier["adapter"] == "dram":
            tier["capacity"] = dram
            tier.setdefault("options", {})["prefault"] = False
        elif tier["adapter"] == "nvme":
            tier["capacity"] = "4GiB"
            tier.setdefault("options", {})["path"] = str(work / "nvme")
    cfg.setdefault("service", {})
    cfg["service"].update({"name": f"demo-{os.getpid()}", "socket": str(work / "ucm.sock"), "metrics_port": None})
    return cfg


def _plot(rows_off: list[dict], rows_on: list[dict], path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    labels = [f"c{r['conv'] + 1}t{r['turn'] + 1}" for r in rows_off]
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.6), 4))
    ax.bar([i - 0.2 for i in x], [r["ttft_s"] * 1000 for r in rows_off], width=0.4, label="vLLM without ucm")
    ax.bar([i + 0.2 for i in x], [r["ttft_s"] * 1000 for r in rows_on], width=0.4, label="vLLM with ucm")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=45, ha="right")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Multi-turn chat replay (SmolLM2-135M, vLLM for CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ucm.apps.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="base YAML (default: configs/default.yaml of this checkout)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dram", default="2GiB", help="DRAM tier of the demo service (default 2GiB)")
    ap.add_argument("--plot", default="out/demo_ttft.png")
    ap.add_argument("--json", default=None, help="also write the rows and stats to this JSON file")
    a = ap.parse_args(argv)

    import ucm
    from ucm.apps.model import prepare

    base = Path(a.config) if a.config else Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
    plot_path = Path(a.plot).resolve()
    json_path = Path(a.json).resolve() if a.json else None
    print("ucm demo: preparing the model ...", flush=True)
    model = str(prepare("smollm2"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = _turn_prompts(tok, _conversations(a.conversations, a.turns))
    work = Path(tempfile.mkdtemp(prefix="ucm-demo-"))
    (work / "nvme").mkdir()
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(_demo_config(base, work, a.dram)))
    cwd = os.getcwd()
    os.chdir(work)  # the service is spawned here, away from a source checkout
    client = None
    try:
        spec = {"model": model, "prompts": prompts, "max_tokens": a.max_tokens}
        print(f"ucm demo: {len(prompts)} turns without ucm (fresh vLLM engine, ~1 min to start) ...", flush=True)
        off = _subprocess(spec, work, "without")
        print(f"ucm demo: starting the ucm service ({base.name}, DRAM {a.dram}, NVMe in {work / 'nvme'}) ...",
              flush=True)
        client = ucm.connect(str(cfg_path))
        if not client.connected:
            print("ucm demo: the ucm service did not start", file=sys.stderr)
            return 1
        print(f"ucm demo: {len(prompts)} turns with ucm ...", flush=True)
        on = _subprocess({**spec, "ucm_config": str(cfg_path)}, work, "with")
        stats = client.stats()
    finally:
        if client is not None:
            client.close()
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    for rows in (off, on):
        for r in rows:
            if r["ttft_s"] is None:
                r["ttft_s"] = r["wall_s"]  # no per-request metrics: the whole call
    print()
    print(f"{'conv':>4} {'turn':>4} {'prompt':>7} {'TTFT no ucm':>12} {'TTFT ucm':>10} {'speedup':>8} "
          f"{'from ucm':>9} {'same output':>11}")
    for r0, r1 in zip(off, on):
        print(f"{r0['conv'] + 1:>4} {r0['turn'] + 1:>4} {r0['prompt_tokens']:>7} {r0['ttft_s'] * 1000:>10.0f}ms "
              f"{r1['ttft_s'] * 1000:>8.0f}ms {r0['ttft_s'] / r1['ttft_s']:>7.2f}x {r1['cached']:>9} "
              f"{str(r0['tokens'] == r1['tokens']):>11}")
    tot0, tot1 = sum(r["ttft_s"] for r in off), sum(r["ttft_s"] for r in on)
    print(f"{'all':>9} {'':>7} {tot0 * 1000:>10.0f}ms {tot1 * 1000:>8.0f}ms {tot0 / tot1:>7.2f}x")
    print("\nucm hits per tier (blocks):")
    for name, t in stats.get("tiers", {}).items():
        print(f"  {name:6s} hits {t.get('hits', 0):>6}  blocks {t.get('blocks', 0):>6}  inserts {t.get('inserts', 0):>6}"
              f"  promotions in {t.get('promotions_in', 0):>4}  demotions in {t.get('demotions_in', 0):>4}")
    # (lookups are answered by the clients from the shared key index, not counted here)
    top = {k: v for k, v in stats.items() if not isinstance(v, dict) and k != "lookups"}
    if top:
        print("  service: " + ", ".join(f"{k} {v}" for k, v in top.items()))
    note = _plot(off, on, plot_path)
    print(f"\n{note}" if note else f"\nplot written to {plot_path}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"without": off, "with": on, "stats": stats}, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run-config":
        Path(sys.argv[3]).write_text(json.dumps(_replay(json.loads(Path(sys.argv[2]).read_text()))))
        sys.exit(0)
    sys.exit(main())
