"""`ucm bench vllm`: time to first token in vLLM (CPU) with and without ucm.

The workload: `--docs` documents of exactly `--doc-tokens`
token ids (deterministic pseudo-random ids, fed as token ids), each asked
twice: pass 1 with one question, pass 2 with another, so pass 2 can reuse
the document's full blocks (2,944 of 3,000 tokens with 128-token blocks).
One request at a time, max_tokens=1 (TTFT = the `generate` call), greedy,
bf16, vLLM prefix caching off except for the APC measurement. Every
configuration runs in a fresh engine in its own subprocess, after one short
warm-up request:

- no connector: pass 1 (a full prefill; pass 2 would be another one);
- vLLM prefix caching: pass 1, then pass 2 hits vLLM's own cache (control);
- ExampleConnector: pass 1 saves to a temp folder, pass 2 loads from it
  (its files still in the OS page cache, i.e. from DRAM); then its files
  are dropped from the page cache (fsync + POSIX_FADV_DONTNEED) and pass 2
  runs again: hits read from the disk, the counterpart of ucm's NVMe-only;
- ucm: pass 1 cold (misses, saves the blocks to a private service's DRAM);
  pass 2 hits DRAM (prefix caching is off, so every reused token comes from
  ucm); then the driver stores filler blocks until `locate` reports every
  document block on NVMe only, and pass 2 runs again: NVMe-only hits
  (staged NVMe -> DRAM by the service, then copied into vLLM's pages).
  The DRAM tier keeps 20 % headroom (one document), made in the background
  between requests, so staging reads NVMe without first writing victims.
  This engine runs with `ucm_load_streaming` auto: the NVMe-only hits are
  streamed layer by layer under the forward, the DRAM hits copied whole;
- ucm, streaming off: a second engine over the same service; NVMe-only
  hits again (pushed back first), loaded asynchronously as whole blocks
  (the path before streaming);
- ucm, streaming on: a third engine; its hits are in DRAM (the previous
  engine staged them) and are streamed too, to compare with the whole-block
  copy of DRAM hits;
- ucm with a codec on the NVMe tier (`--codecs`, default lossless,int8): per
  codec a private service and an engine, NVMe-only hits decoded on staging
  (ucm/bench/engines/vllm_bench_codec.py); lossless must equal vLLM's own hit.
  `--codec-streaming off,auto` measures each codec twice: loaded
  asynchronously (`off`, the default) and streamed layer by layer (`auto`).

Every hit is measured `--repeat` times over all the documents (pass 2 again;
before each NVMe-only round the filler pushes the documents out of DRAM
again, before each ExampleConnector disk round its files are dropped from
the page cache again), so that one slow moment of these shared vCPUs does
not decide a comparison. Cold and no-connector TTFTs have one sample per
document (a second pass would be a hit).

`outputs_equal`: the first token of every ucm hit (every round) equals the
APC hit's for the same prompt, the first token of every ucm cold run equals
the no-connector run's, and an extra 8-token greedy continuation of every
pass-2 prompt from ucm (after the timings) equals the APC one. The
`*_ttft_s` keys are medians over documents x rounds, in seconds; `mean_ttft_s`
gives the means, `per_doc_ttft_s` every sample. Environment defaults (kept if already set):
VLLM_CPU_KVCACHE_SPACE=1, VLLM_CPU_OMP_THREADS_BIND=0-(cores-1),
HF_HUB_OFFLINE=1; every configuration runs with the same thread binding.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from ucm.apps.engine_env import bench_env, run_spec
from ucm.bench import common
from ucm.bench.blocks import push_below_dram, tier_counts
from ucm.bench.engines.ttft_workload import CHECK_TOKENS, documents
from ucm.bench.engines.vllm_engine import BLOCK_TOKENS, make_engine, namespace, phase, rounds, shutdown, timed
from ucm.progress import bar

# The ucm engines and their `ucm_load_streaming`.
UCM_STREAMING = {"ucm": "auto", "ucm_stream_off": "off", "ucm_stream_on": "on"}


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "vllm", help="TTFT in vLLM: no connector, APC, ExampleConnector, ucm cold/DRAM/NVMe "
                                       "(streamed and not)",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_counts(p, docs=(4, "documents"), doc_tokens=(3000, "tokens per document"))
    common.add_model_flag(p)
    common.add_counts(p, repeat=(3, "rounds of every hit measurement"))
    p.add_argument("--codecs", default="lossless,int8",
                   help="codecs of the NVMe tier to measure NVMe-only hits with, comma-separated "
                        "(default lossless,int8; '' for none)")
    p.add_argument("--codec-streaming", default="off",
                   help="ucm_load_streaming of the codec runs, comma-separated: off (default; the "
                        "asynchronous whole-block load), auto (streamed layer by layer), or off,auto")
    common.add_json_flag(p)


def _prompts(model: str, docs: int, doc_tokens: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    from transformers import AutoTokenizer

    return documents(AutoTokenizer.from_pretrained(model), docs, doc_tokens)


def _evict_to_nvme(client: Any, keys: list[bytes], block_bytes: int) -> dict[str, int]:
    """Filler until every key of `keys` is below DRAM; where they are then."""
    return tier_counts(push_below_dram(client, keys, block_bytes, limit=200))


# ---- one configuration in one engine (runs in a subprocess) -----------------
def _run_config(spec: dict) -> dict:
    """One configuration in one engine: the phases named in spec["config"]."""
    pass1, pass2, warm = spec["pass1"], spec["pass2"], spec["warm"]
    name = spec["config"]
    n_rounds = int(spec.get("repeat", 1))
    max_len = max(len(p) for p in pass1 + pass2) + 64
    kv: Optional[dict] = None
    if name == "example":
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": spec["example_dir"]}}
    elif name in UCM_STREAMING or name == "ucm_codec":
        kv = {"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.connectors.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"ucm_config": spec["ucm_config"],
                                            "ucm_load_streaming": spec.get("codec_streaming", "off")
                                            if name == "ucm_codec" else UCM_STREAMING.get(name, "off")}}
    llm = make_engine(spec["model"], max_len, prefix_caching=(name == "apc"), kv=kv)
    timed(llm, [warm])  # first forward pays one-time costs in every configuration
    out: dict[str, Any] = {}
    if name == "ucm_codec":
        from ucm.bench.engines.vllm_bench_codec import run_codec_config

        out = run_codec_config(llm, spec)
        shutdown(llm)
        return out
    if name in ("ucm_stream_off", "ucm_stream_on"):
        out.update(_other_streaming(llm, spec, name, pass2, n_rounds))
        shutdown(llm)
        return out
    out["pass1"] = phase(llm, pass1)
    if name != "none":  # without a connector pass 2 is another full prefill: pass 1 measures it
        out["pass2"] = rounds(llm, pass2, n_rounds)
    if name == "apc":
        out["check"] = phase(llm, pass2, CHECK_TOKENS)
    elif name == "example":
        # Its files read back from the disk, as ucm's NVMe-only hits are.
        out["disk"] = rounds(llm, pass2, n_rounds, before=lambda: _drop_page_cache(Path(spec["example_dir"])))
    elif name == "ucm":
        import ucm
        from ucm.keys import block_keys

        client = ucm.connect(spec["ucm_config"], start=False)
        ns = namespace(llm.llm_engine.vllm_config)
        keys = [k for p in pass2 for k in block_keys(ns, p, BLOCK_TOKENS)]
        out["tiers_before_evict"] = tier_counts(client.locate(keys))
        out["tiers_nvme_phase"] = []

        def evict() -> None:
            out["tiers_nvme_phase"].append(_evict_to_nvme(client, keys, spec["block_bytes"]))

        stats0 = client.stats()
        out["nvme"] = rounds(llm, pass2, n_rounds, before=evict)
        out["check"] = phase(llm, pass2, CHECK_TOKENS)
        stats1 = client.stats()
        out["promotions"] = stats1["tiers"]["dram"].get("promotions_in", 0) - stats0["tiers"]["dram"].get(
            "promotions_in", 0)
        client.close()
    shutdown(llm)
    return out


def _other_streaming(llm, spec: dict, name: str, pass2: list[list[int]], n_rounds: int) -> dict[str, Any]:
    """The second and third ucm engines: NVMe-only hits with streaming off,
    or DRAM hits streamed (on)."""
    import ucm
    from ucm.keys import block_keys

    client = ucm.connect(spec["ucm_config"], start=False)
    keys = [k for p in pass2 for k in block_keys(namespace(llm.llm_engine.vllm_config), p, BLOCK_TOKENS)]
    out: dict[str, Any] = {"tiers_before": []}
    try:
        if name == "ucm_stream_off":
            def before() -> None:
                out["tiers_before"].append(_evict_to_nvme(client, keys, spec["block_bytes"]))
        else:
            def before() -> None:
                out["tiers_before"].append(tier_counts(client.locate(keys)))
        out["hit"] = rounds(llm, pass2, n_rounds, before=before)
        out["streamed_blocks"] = client.stats().get("streamed_blocks", 0)
    finally:
        client.close()
    return out


def _drop_page_cache(root: Path) -> None:
    """Evicts the files under `root` from the OS page cache."""
    from ucm.bench.cache.io import drop_page_cache

    for path in root.rglob("*"):
        if path.is_file():
            drop_page_cache(str(path))


# ---- the driver ---------------------------------------------------------------
def _subprocess(spec: dict, work: Path) -> dict:
    return run_spec("ucm.bench.engines.vllm_bench", spec, work, spec["config"], f"configuration {spec['config']!r}",
                    flags=("--run-config",))


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4)


def _median(xs: list[float]) -> float:
    import statistics

    return round(statistics.median(xs), 4)


def measure(docs: int, doc_tokens: int, model_name: str = "smollm2", log=print,
            repeat: int = 3, codecs: tuple[str, ...] = (),
            codec_streaming: tuple[str, ...] = ("off",)) -> dict[str, Any]:
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    from ucm.bench.engines.vllm_bench_codec import CODEC_STREAMING
    from ucm.codecs import codec_names

    unknown = [c for c in codecs if c not in codec_names()]
    if unknown:
        raise ValueError(f"--codecs: unknown codec(s) {unknown}; allowed: {codec_names()}")
    bad = [m for m in codec_streaming if m not in CODEC_STREAMING]
    if bad or not codec_streaming or len(set(codec_streaming)) != len(codec_streaming):
        raise ValueError(f"--codec-streaming: got {list(codec_streaming)}; allowed: distinct values of "
                         f"{list(CODEC_STREAMING)}")
    import yaml

    import ucm
    from ucm.apps.model import prepare
    os.environ.update({k: v for k, v in bench_env().items() if k not in os.environ})
    model = str(prepare(model_name))
    pass1, pass2, warm = _prompts(model, docs, doc_tokens)
    work = Path(tempfile.mkdtemp(prefix="ucm-bench-vllm-"))
    block_bytes = 30 * 3 * 128 * 2 * 64 * 2  # SmolLM2 bf16: 30 layers x 3 KV heads x 128 tokens x K|V x 64 x 2 B
    blocks = docs * (doc_tokens // BLOCK_TOKENS)
    dram_bytes = max(64 << 20, (blocks + 8) * block_bytes * 3 // 2)
    cfg = {
        "block_tokens": BLOCK_TOKENS,
        "tiers": [
            # Headroom: one document's blocks (20 % of this small tier) kept free, as the default
            # 5 % of 4 GiB does for a prompt of this size, so a hit staged from NVMe finds room.
            {"adapter": "dram", "capacity": f"{dram_bytes >> 20}MiB", "headroom": 0.2,
             "options": {"path": "/dev/shm", "prefault": False}},
            {"adapter": "nvme", "capacity": f"{max(1024, 4 * dram_bytes >> 20)}MiB",
             "options": {"path": str(work / "nvme"), "region_size": "16MiB", "direct_io": True}},
        ],
        "policy": {"name": "lru"},
        "service": {"name": f"bench-vllm-{os.getpid()}", "socket": str(work / "ucm.sock")},
    }
    (work / "nvme").mkdir()
    (work / "example").mkdir()
    cfg_path = work / "ucm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    base = {"model": model, "pass1": pass1, "pass2": pass2, "warm": warm, "block_bytes": block_bytes,
            "repeat": repeat}
    res: dict[str, dict] = {}
    cwd = os.getcwd()
    os.chdir(work)  # a private service is spawned as `python -m ucm.cli` here, away from a source checkout
    client = None
    try:
        client = ucm.connect(str(cfg_path))  # the private service outlives the engine
        if not client.connected:
            raise RuntimeError("could not start the ucm service")
        with bar(total=6 + len(codecs) * len(codec_streaming), desc="bench vllm", unit="config") as configs:
            for name in UCM_STREAMING:
                log(f"[bench vllm] {name} ...")
                configs.set_postfix_str(name)
                res[name] = _subprocess({**base, "config": name, "ucm_config": str(cfg_path)}, work)
                configs.update(1)
                if name == "ucm":
                    service = client.stats()
            for name in ("none", "apc", "example"):
                log(f"[bench vllm] {name} ...")
                configs.set_postfix_str(name)
                res[name] = _subprocess({**base, "config": name, "example_dir": str(work / "example")}, work)
                configs.update(1)
            if codecs:
                from ucm.bench.engines.vllm_bench_codec import run_codecs

                configs.set_postfix_str("codecs")

                def one(spec: dict) -> dict:
                    out = _subprocess(spec, work)
                    configs.update(1)
                    return out

                res["codecs"] = run_codecs(list(codecs), cfg, work, base, one, log, codec_streaming)
    finally:
        if client is not None:
            client.close()
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    return summarize(res, docs, doc_tokens, len(pass1[0]), len(pass2[0]), repeat, service)


def summarize(res: dict[str, dict], docs: int, doc_tokens: int, pass1_tokens: int, pass2_tokens: int,
              repeat: int, service: dict) -> dict[str, Any]:
    """The JSON of the bench from what each configuration's subprocess returned."""
    none, apc, ex, u = res["none"], res["apc"], res["example"], res["ucm"]
    off, on = res["ucm_stream_off"], res["ucm_stream_on"]
    first = lambda ph: [t[0] for t in ph["tokens"]]  # noqa: E731
    ref = first(apc["pass2"])[:docs]  # APC's first round; every round of every hit must give the same
    hit_eq = lambda ph: len(ref) == docs and first(ph) == ref * repeat  # noqa: E731
    eq = {
        "ucm_cold_vs_no_connector_first_token": first(u["pass1"]) == first(none["pass1"]),
        "apc_rounds_agree": hit_eq(apc["pass2"]),
        "ucm_dram_hit_vs_apc_first_token": hit_eq(u["pass2"]),
        "ucm_nvme_hit_vs_apc_first_token": hit_eq(u["nvme"]),
        "ucm_nvme_hit_stream_off_vs_apc_first_token": hit_eq(off["hit"]),
        "ucm_dram_hit_streamed_vs_apc_first_token": hit_eq(on["hit"]),
        f"ucm_hit_vs_apc_{CHECK_TOKENS}_tokens": u["check"]["tokens"] == apc["check"]["tokens"],
        "example_hit_vs_apc_first_token": hit_eq(ex["pass2"]),
        "example_disk_hit_vs_apc_first_token": hit_eq(ex["disk"]),
    }
    samples = {"no_connector": none["pass1"], "apc_hit": apc["pass2"], "example_connector_hit": ex["pass2"],
               "example_connector_disk_hit": ex["disk"], "ucm_cold": u["pass1"], "ucm_dram_hit": u["pass2"],
               "ucm_nvme_hit": u["nvme"], "ucm_nvme_hit_stream_off": off["hit"],
               "ucm_dram_hit_streamed": on["hit"], "apc_cold": apc["pass1"], "example_connector_cold": ex["pass1"]}
    r = {
        "docs": docs, "doc_tokens": doc_tokens, "pass1_tokens": pass1_tokens, "pass2_tokens": pass2_tokens,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "repeat": repeat, "statistic": "median",
        **{f"{k}_ttft_s": _median(ph["ttft_s"]) for k, ph in samples.items()},
        "mean_ttft_s": {k: _mean(ph["ttft_s"]) for k, ph in samples.items()},
        "cached_tokens": {"apc_hit": apc["pass2"]["cached"], "example_hit": ex["pass2"]["cached"],
                          "ucm_cold": u["pass1"]["cached"], "ucm_dram_hit": u["pass2"]["cached"],
                          "ucm_nvme_hit": u["nvme"]["cached"], "ucm_nvme_hit_stream_off": off["hit"]["cached"],
                          "ucm_dram_hit_streamed": on["hit"]["cached"]},
        "ucm_tiers_before_nvme_phase": u["tiers_nvme_phase"],
        "ucm_tiers_before_stream_off_phase": off["tiers_before"],
        "ucm_tiers_before_streamed_dram_phase": on["tiers_before"],
        "ucm_streamed_blocks": {"stream_off": off["streamed_blocks"], "stream_on": on["streamed_blocks"]},
        "ucm_promotions_nvme_phase": u["promotions"],
        "outputs_equal": all(eq.values()),
        "outputs_equal_detail": eq,
        "per_doc_ttft_s": {k: ph["ttft_s"] for k, ph in samples.items()},
        "ucm_service": {k: v for k, v in service.items() if not isinstance(v, dict)},
    }
    if res.get("codecs"):
        from ucm.bench.engines.vllm_bench_codec import codec_outputs_equal, summarize_codecs

        r["ucm_nvme_codecs"] = summarize_codecs(res["codecs"], apc, ref, repeat, r["ucm_dram_hit_ttft_s"],
                                                r["apc_hit_ttft_s"], _median)
        eq["ucm_nvme_hit_lossless_codecs_vs_apc"] = codec_outputs_equal(r["ucm_nvme_codecs"])
        r["outputs_equal"] = all(eq.values())
    nc, apc_hit = r["no_connector_ttft_s"], r["apc_hit_ttft_s"]
    r["ratios"] = {
        "ucm_cold_over_no_connector": round(r["ucm_cold_ttft_s"] / nc, 3),
        "ucm_dram_hit_over_apc_hit": round(r["ucm_dram_hit_ttft_s"] / apc_hit, 3),
        "ucm_nvme_hit_over_apc_hit": round(r["ucm_nvme_hit_ttft_s"] / apc_hit, 3),
        "ucm_nvme_hit_over_dram_hit": round(r["ucm_nvme_hit_ttft_s"] / r["ucm_dram_hit_ttft_s"], 3),
        "ucm_nvme_hit_stream_off_over_apc_hit": round(r["ucm_nvme_hit_stream_off_ttft_s"] / apc_hit, 3),
        "ucm_nvme_hit_stream_off_over_dram_hit": round(r["ucm_nvme_hit_stream_off_ttft_s"] / r["ucm_dram_hit_ttft_s"],
                                                       3),
        "ucm_dram_hit_streamed_over_dram_hit": round(r["ucm_dram_hit_streamed_ttft_s"] / r["ucm_dram_hit_ttft_s"], 3),
        "ucm_dram_hit_over_example_hit": round(r["ucm_dram_hit_ttft_s"] / r["example_connector_hit_ttft_s"], 3),
        "ucm_nvme_hit_over_example_hit": round(r["ucm_nvme_hit_ttft_s"] / r["example_connector_hit_ttft_s"], 3),
        "ucm_nvme_hit_over_example_disk_hit": round(r["ucm_nvme_hit_ttft_s"] / r["example_connector_disk_hit_ttft_s"],
                                                    3),
    }
    return r


def run(args: argparse.Namespace) -> int:
    codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip())
    modes = tuple(m.strip() for m in args.codec_streaming.split(",") if m.strip())
    return common.run_measured(
        args, "vllm", lambda log: measure(args.docs, args.doc_tokens, args.model, log=log, repeat=args.repeat,
                                          codecs=codecs, codec_streaming=modes),
        table, errors=(RuntimeError, ValueError, subprocess.TimeoutExpired))


def table(r: dict[str, Any]) -> str:
    """The medians, their ratios, the codec runs and `outputs_equal`."""
    lines = [f"{k:32s} {r[k]:8.3f}" for k in (
        "no_connector_ttft_s", "apc_hit_ttft_s", "example_connector_hit_ttft_s", "example_connector_disk_hit_ttft_s",
        "ucm_cold_ttft_s", "ucm_dram_hit_ttft_s", "ucm_nvme_hit_ttft_s", "ucm_nvme_hit_stream_off_ttft_s",
        "ucm_dram_hit_streamed_ttft_s")]
    lines += [f"{k:32s} {v:8.3f}" for k, v in r["ratios"].items()]
    for codec, c in r.get("ucm_nvme_codecs", {}).items():
        lines.append(f"{'ucm_nvme_hit_' + codec + '_ttft_s':32s} {c['nvme_hit_ttft_s']:8.3f}  (over DRAM hit "
                     f"{c['nvme_hit_over_dram_hit']:.3f}, first tokens agree {c['first_token_agreement']:.3f}, "
                     f"checks equal {c['check_tokens_equal']}/{c['check_prompts']})")
    lines.append(f"{'outputs_equal':32s} {r['outputs_equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run-config":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(_run_config(spec)))
        sys.exit(0)
    sys.exit(common.main("python -m ucm.bench.engines.vllm_bench", __doc__, _add_args, run))
