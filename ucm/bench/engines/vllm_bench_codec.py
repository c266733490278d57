"""`ucm bench vllm --codecs ...`: NVMe-only hits whose NVMe tier stores
blocks through a codec (`tiers[].codec`), next to the raw figures of the
same run.

For each codec and each `--codec-streaming` mode a private service is
started with the bench's tiers and that codec on the NVMe tier (its own
socket and NVMe directory). One engine (`ucm_load_streaming` as that mode:
`off`, the default, the asynchronous whole-block load; `auto`, the NVMe
hit streamed layer by layer under the forward, a codec tier decoding range
by range) runs pass 1 cold (the blocks are saved to DRAM raw), then
`--repeat` rounds of pass 2 after filler has pushed every document block
to NVMe (demotion encodes it; the hit stages it back and decodes it), and
the greedy check (`CHECK_TOKENS`). A run is keyed by its codec (`off`) or
`<codec>_streamed` (`auto`). Outputs are compared with vLLM's own
prefix-cache hit: `lossless` must equal it token for token; a lossy
codec's agreement is reported, not required.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import yaml

from ucm.bench.blocks import push_below_dram, tier_counts
from ucm.bench.engines.ttft_workload import CHECK_TOKENS
from ucm.bench.engines.vllm_engine import BLOCK_TOKENS, namespace, phase, rounds

LOSSLESS = ("none", "lossless")

# `--codec-streaming` modes: the vLLM connector's `ucm_load_streaming` an
# NVMe-only codec hit is measured with (`on` streams DRAM hits too, which a
# codec never sees).
CODEC_STREAMING = ("off", "auto")


def run_label(codec: str, streaming: str) -> str:
    """The key of one codec run: the codec (`off`), `<codec>_streamed` (`auto`)."""
    return codec if streaming == "off" else f"{codec}_streamed"


def codec_config(cfg: dict, work: Path, codec: str, label: str = "") -> Path:
    """The bench's config with `codec` on its NVMe tier, a socket and an
    NVMe directory of its own (named by `label`, the codec by default);
    its path."""
    label = label or codec
    c = copy.deepcopy(cfg)
    (work / f"nvme-{label}").mkdir()
    for tier in c["tiers"]:
        if tier["adapter"] == "nvme":
            tier["codec"] = codec
            tier["options"]["path"] = str(work / f"nvme-{label}")
    c["service"] = {**c["service"], "name": f"{c['service']['name']}-{label}",
                    "socket": str(work / f"ucm-{label}.sock")}
    path = work / f"ucm-{label}.yaml"
    path.write_text(yaml.safe_dump(c))
    return path


def run_codecs(codecs: list[str], cfg: dict, work: Path, base: dict, run: Callable[[dict], dict],
               log: Callable[..., Any], streaming: tuple[str, ...] = ("off",)) -> dict[str, dict]:
    """Every codec's engine run per streaming mode (`run(spec)` runs one
    configuration in its subprocess), each beside a private service of its
    own; keyed by `run_label`."""
    import ucm

    out: dict[str, dict] = {}
    for codec in codecs:
        for mode in streaming:
            label = run_label(codec, mode)
            path = codec_config(cfg, work, codec, label)
            log(f"[bench vllm] ucm, NVMe codec {codec}, load streaming {mode} ...")
            client = ucm.connect(str(path))
            try:
                if not client.connected:
                    raise RuntimeError(f"could not start the ucm service for codec {codec}")
                res = run({**base, "config": "ucm_codec", "ucm_config": str(path), "codec": codec,
                           "codec_streaming": mode})
                nvme = client.stats().get("tiers", {}).get("nvme", {})
                res["codec_stats"] = {k: v for k, v in nvme.get("adapter", {}).items() if "codec" in k}
                res["nvme_stats"] = {k: v for k, v in nvme.items() if not isinstance(v, dict)}
                res["codec"], res["load_streaming"] = codec, mode
                out[label] = res
            finally:
                client.close()
    return out


def run_codec_config(llm: Any, spec: dict) -> dict[str, Any]:
    """In the engine's subprocess: pass 1 cold, NVMe-only rounds, the check."""
    import ucm
    from ucm.keys import block_keys

    pass1, pass2, n_rounds = spec["pass1"], spec["pass2"], int(spec.get("repeat", 1))
    out: dict[str, Any] = {"pass1": phase(llm, pass1), "tiers_before": []}
    client = ucm.connect(spec["ucm_config"], start=False)
    try:
        ns = namespace(llm.llm_engine.vllm_config)
        keys = [k for p in pass2 for k in block_keys(ns, p, BLOCK_TOKENS)]

        def before() -> None:
            out["tiers_before"].append(tier_counts(push_below_dram(client, keys, spec["block_bytes"], limit=200)))

        out["nvme"] = rounds(llm, pass2, n_rounds, before=before)
        before()
        out["check"] = phase(llm, pass2, CHECK_TOKENS)
    finally:
        client.close()
    return out


def summarize_codecs(res: dict[str, dict], apc: dict, ref_first: list[int], repeat: int, dram_hit_s: float,
                     apc_hit_s: float, median: Callable[[list[float]], float]) -> dict[str, Any]:
    """Per codec: the NVMe-only hit's median TTFT, its ratios to the raw DRAM
    hit and to vLLM's prefix-cache hit, output agreement with that hit, the
    tiers the documents were on before each round, and the NVMe tier's
    stored bytes."""
    out: dict[str, Any] = {}
    for codec, r in res.items():
        first = [t[0] for t in r["nvme"]["tokens"]]
        want = ref_first * repeat
        agree = sum(a == b for a, b in zip(first, want)) / max(1, len(want))
        check = [a == b for a, b in zip(r["check"]["tokens"], apc["check"]["tokens"])]
        t = median(r["nvme"]["ttft_s"])
        out[codec] = {
            "codec": r.get("codec", codec), "load_streaming": r.get("load_streaming", "off"),
            "nvme_hit_ttft_s": t,
            "nvme_hit_over_dram_hit": round(t / dram_hit_s, 3),
            "nvme_hit_over_apc_hit": round(t / apc_hit_s, 3),
            "first_token_agreement": round(agree, 3),
            "check_tokens_equal": sum(check), "check_prompts": len(check),
            "cached_tokens": r["nvme"]["cached"],
            "tiers_before_rounds": r["tiers_before"],
            "per_doc_ttft_s": r["nvme"]["ttft_s"],
            "codec_stats": r.get("codec_stats", {}), "nvme_stats": r.get("nvme_stats", {}),
        }
    return out


def codec_outputs_equal(summary: dict[str, Any]) -> bool:
    """What the lossless codecs must give: every first token and every check
    continuation of vLLM's own prefix-cache hit."""
    return all(s["first_token_agreement"] == 1.0 and s["check_tokens_equal"] == s["check_prompts"]
               for s in summary.values() if s["codec"] in LOSSLESS)
