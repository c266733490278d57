"""`ucm bench trace`: replay a request trace through the placement policies.

Replays a Mooncake-format trace (see ucm/bench/cache/traces.py) through the placement engine, the
metadata half of UnifiedCache, with each named policy (`ucm.policies` entry
points) and each capacity, and reports hit ratios, per-tier hits, NVMe bytes
written and the prefill time saved (cost model in ucm/bench/cache/replay.py).
One tier (`--capacity-tokens`, a list sweeps) or two (`--dram` and `--nvme`).
With `--bytes SIZE` the replay moves real payloads through a UnifiedCache
and checks every hit (ucm/bench/cache/payload.py). Runs in the calling process,
one replay at a time.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from ucm.bench.cache.replay import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_DRAM_GBPS,
    DEFAULT_NVME_GBPS,
    DEFAULT_PREFILL_MS_PER_TOKEN,
    CostModel,
    ReplayResult,
    TraceReplay,
)
from ucm.bench.common import Subparsers, add_bench, add_json_flag
from ucm.errors import ArgumentError
from ucm.placement.heat import HeatTracker
from ucm.placement import TierSpec, make_placement
from ucm.placement.policies.base import POLICY_NAMESPACE, load_policy
from ucm.progress import bar
from ucm.config.sizes import parse_size
from ucm.bench.cache.traces import BLOCK_TOKENS, TraceRequest, read_trace

log = logging.getLogger(__name__)

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*$", re.IGNORECASE)
_TOKEN_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str) -> int:
    """'1M' -> 1_000_000 tokens (suffixes K, M, G are powers of 1000)."""
    m = _TOKENS.match(text)
    if not m:
        raise ArgumentError(f"token count {text!r} is not a number with an optional "
                            f"K, M or G suffix (e.g. 3M)")
    return int(float(m.group(1)) * _TOKEN_SCALE[m.group(2).lower()])


def parse_tier_size(text: str, block_bytes: int, block_tokens: int) -> tuple[int, int]:
    """A tier size -> (tokens, bytes). Ending in B it is bytes ('64GiB',
    '500GB'); otherwise tokens ('1M'). The bytes hold whole blocks only."""
    if text.strip().lower().endswith("b"):
        try:
            blocks = parse_size(text) // block_bytes
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        return blocks * block_tokens, blocks * block_bytes
    tokens = parse_tokens(text)
    return tokens, tokens // block_tokens * block_bytes


def policy_names(text: str) -> list[str]:
    """'lru,heat' -> ['lru', 'heat']; 'all' -> every registered policy."""
    if text.strip() == "all":
        from stevedore import ExtensionManager

        mgr = ExtensionManager(namespace=POLICY_NAMESPACE, invoke_on_load=False)
        names = sorted(mgr.names())
        # Baselines first, ours and the bound last, so tables read left to right.
        tail = [n for n in ("heat", "opt") if n in names]
        return [n for n in names if n not in tail] + tail
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ArgumentError("--policy needs at least one policy name, or 'all'")
    return names


def bandwidths(args: argparse.Namespace) -> tuple[float, float]:
    """(DRAM, NVMe) load GB/s: the flags, else --io-json, else the defaults."""
    measured: dict = {}
    if args.io_json:
        try:
            with open(args.io_json, encoding="utf-8") as f:
                measured = json.load(f)
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"--io-json {args.io_json!r}: cannot read `ucm bench io --json` "
                                f"output: {exc}") from None
        if not isinstance(measured, dict):
            raise ArgumentError(f"--io-json {args.io_json!r}: expected a JSON object")
    out = []
    for flag, key, default in ((args.dram_gbps, "dram_load_gbps", DEFAULT_DRAM_GBPS),
                               (args.nvme_gbps, "nvme_load_gbps", DEFAULT_NVME_GBPS)):
        value = flag if flag is not None else measured.get(key) or default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ArgumentError(f"load bandwidth {key} must be a number > 0 GB/s, got {value!r}")
        out.append(float(value))
    return out[0], out[1]


def run_one(requests: Sequence[TraceRequest], policy: str, tiers: Sequence[tuple[str, int, int]],
            cost: CostModel, block_tokens: int = BLOCK_TOKENS) -> ReplayResult:
    """Replays `requests` with `policy` over `tiers` = [(name, tokens, bytes)]."""
    factory = load_policy(policy)
    placement = make_placement([TierSpec(name, nbytes) for name, _, nbytes in tiers], factory,
                               heat=HeatTracker())
    replay = TraceReplay(placement, cost, policy_name=policy, block_tokens=block_tokens,
                         capacity_tokens=[tok for _, tok, _ in tiers])
    return replay.replay(requests)


def gap_closed(results: Sequence[ReplayResult]) -> dict[tuple[str, str], float]:
    """(policy, capacity label) -> share of the LRU-to-OPT hit-ratio gap it
    closes (0 = LRU, 1 = OPT), where both ran at that capacity."""
    by: dict[tuple[str, str], float] = {}
    for r in results:
        by[(r.policy, _capacity_label(r))] = r.hit_ratio
    out = {}
    for r in results:
        cap = _capacity_label(r)
        lo, hi = by.get(("lru", cap)), by.get(("opt", cap))
        if lo is not None and hi is not None and hi > lo:
            out[(r.policy, cap)] = (r.hit_ratio - lo) / (hi - lo)
    return out


def _capacity_label(r: ReplayResult) -> str:
    return "+".join(_tokens_label(t["capacity_tokens"]) for t in r.tiers)


def _tokens_label(n: int) -> str:
    for div, suf in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.4g}{suf}"
    return str(n)


def format_table(results: Sequence[ReplayResult]) -> str:
    gaps = gap_closed(results)
    head = ("policy", "capacity", "hit%", "token%", "dram_hits", "nvme_hits", "misses",
            "nvme_GB_written", "saved%", "gap_closed", "time_s")
    rows = [head]
    for r in results:
        cap = _capacity_label(r)
        g = gaps.get((r.policy, cap))
        d = r.to_dict()
        rows.append((r.policy, cap, f"{100 * r.hit_ratio:.2f}", f"{100 * r.token_hit_ratio:.2f}",
                     str(d["dram_hits"]), str(d["nvme_hits"]), str(r.misses),
                     f"{d['nvme_bytes_written'] / 1e9:.1f}", f"{100 * r.prefill_saved_ratio:.2f}",
                     "" if g is None else f"{g:.2f}", f"{r.elapsed_s:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def plot(results: Sequence[ReplayResult], out: Path, title: str) -> None:
    """Hit ratio against capacity (log scale), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = list(dict.fromkeys(r.policy for r in results))
    palette = iter(["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown",
                    "tab:pink", "tab:olive", "tab:cyan", "tab:gray"] * 4)
    for name in policies:
        pts = sorted((r.tiers[0]["capacity_tokens"], r.hit_ratio)
                     for r in results if r.policy == name)
        if name == "heat":
            style = dict(color="tab:red", linewidth=2.5, zorder=3)
        elif name == "opt":
            style = dict(color="black", linestyle="--")
        else:
            style = dict(color=next(palette), linewidth=1.2)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", markersize=3,
                label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("prefix hit ratio (% of block occurrences)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def handle(args: argparse.Namespace) -> int:
    block_bytes, block_tokens = args.block_bytes, args.block_tokens
    payload_bytes = None
    if args.bytes is not None:
        try:
            payload_bytes = parse_size(args.bytes)
        except ValueError as exc:
            raise ArgumentError(f"--bytes: {exc}") from None
        if payload_bytes <= 0:
            raise ArgumentError(f"--bytes must be > 0 bytes per block, got {args.bytes!r}")
    if args.live and payload_bytes is None:
        raise ArgumentError("--live replays real payloads: give --bytes SIZE too")
    if args.chunk_blocks <= 0:
        raise ArgumentError(f"--chunk-blocks must be > 0, got {args.chunk_blocks}")
    if args.live and "opt" in policy_names(args.policy):
        raise ArgumentError("--live drives a live cache: opt needs the future (metadata or --bytes replay only)")
    if args.limit is not None and args.limit <= 0:
        raise ArgumentError(f"--limit must be > 0 requests, got {args.limit}")
    if block_bytes <= 0 or block_tokens <= 0:
        raise ArgumentError(f"--block-bytes and --block-tokens must be > 0, "
                            f"got {block_bytes} and {block_tokens}")
    if (args.dram is None) != (args.nvme is None):
        raise ArgumentError("two tiers need both --dram and --nvme")
    if args.capacity_tokens is None and args.dram is None:
        raise ArgumentError("give --capacity-tokens N[,N...] (one tier) or --dram and --nvme")
    if args.capacity_tokens is not None and args.dram is not None:
        raise ArgumentError("--capacity-tokens (one tier) excludes --dram/--nvme (two tiers)")
    configs: list[list[tuple[str, int, int]]] = []
    if args.capacity_tokens is not None:
        for text in args.capacity_tokens.split(","):
            tokens = parse_tokens(text)
            if tokens < block_tokens:
                raise ArgumentError(f"capacity {text!r} holds no whole {block_tokens}-token block")
            configs.append([("dram", tokens, tokens // block_tokens * block_bytes)])
    else:
        if args.plot:
            raise ArgumentError("--plot draws hit ratio against --capacity-tokens (one tier)")
        dram = parse_tier_size(args.dram, block_bytes, block_tokens)
        nvme = parse_tier_size(args.nvme, block_bytes, block_tokens)
        if dram[1] <= 0 or nvme[1] <= 0:
            raise ArgumentError(f"--dram {args.dram!r} and --nvme {args.nvme!r} must each hold "
                                f"at least one {block_bytes}-byte block")
        ratio = args.codec_ratio
        if ratio != 1.0:  # the NVMe tier's codec: its bytes hold ratio x more blocks, each hit moves 1/ratio
            blocks = int(nvme[1] // block_bytes * ratio)
            nvme = (blocks * block_tokens, blocks * block_bytes)
        configs.append([("dram", *dram), ("nvme", *nvme)])
    if args.codec_ratio != 1.0 and args.dram is None:
        raise ArgumentError("--codec-ratio applies to the NVMe tier: give --dram and --nvme")
    if not 1.0 <= args.codec_ratio <= 64.0:
        raise ArgumentError(f"--codec-ratio must be in [1, 64], got {args.codec_ratio}")
    gbps = bandwidths(args)
    if args.codec_ratio != 1.0:
        gbps = (gbps[0], gbps[1] * args.codec_ratio)  # decode time not counted (ucm bench codec measures it)
    cost = CostModel(args.prefill_ms_per_token, block_bytes, gbps[:len(configs[0])])
    if payload_bytes is not None:
        # Each tier keeps its number of blocks; blocks shrink to the payload
        # size, bandwidths with them, so the cost model gives the same times.
        scale = payload_bytes / block_bytes
        configs = [[(name, tok, nbytes // block_bytes * payload_bytes) for name, tok, nbytes in t]
                   for t in configs]
        cost = CostModel(args.prefill_ms_per_token, payload_bytes,
                         tuple(g * scale for g in cost.tier_gbps))
    policies = policy_names(args.policy)
    for name in policies:
        load_policy(name)  # fail before the long part
    requests = read_trace(args.trace, block_tokens)
    if args.limit is not None:
        requests = requests[:args.limit]
    results: list[ReplayResult] = []
    steps = bar(total=len(configs) * len(policies), desc="bench trace", unit="replay")
    for tiers in configs:
        for name in policies:
            steps.set_postfix_str(name)
            extra: dict = {}
            if payload_bytes is None:
                r = run_one(requests, name, tiers, cost, block_tokens)
            elif args.live:
                from ucm.bench.cache.live import run_live

                r, live = run_live(requests, name, tiers, cost, block_tokens, args.bytes_dir, args.chunk_blocks)
                extra = {f"live_{k}": v for k, v in asdict(live).items()}
                extra["payload_block_bytes"] = payload_bytes
            else:
                from ucm.bench.cache.payload import run_payload

                r, counts = run_payload(requests, name, tiers, cost, block_tokens, args.bytes_dir)
                extra = {f"payload_{k}": v for k, v in asdict(counts).items()}
                extra["payload_block_bytes"] = payload_bytes
            log.info("%s %s: hit ratio %.4f in %.1f s", name, _capacity_label(r), r.hit_ratio,
                     r.elapsed_s)
            results.append(r)
            steps.update(1)
            if args.json:
                print(json.dumps({**r.to_dict(), **extra}), flush=True)
            elif extra:
                print(f"{name} {_capacity_label(r)}: " + ", ".join(
                    f"{k} {v}" for k, v in extra.items()), flush=True)
    steps.close()
    if not args.json:
        print(format_table(results))
    if args.plot:
        plot(results, Path(args.plot), f"{Path(args.trace).name}: prefix hit ratio")
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def register(subparsers: Subparsers) -> None:
    add_bench(
        subparsers, "trace", help="replay a request trace through the placement policies",
        description=(
            "Replay a Mooncake-format trace (one JSON request per line, hash_ids = chained ids "
            "of 512-token blocks) through the placement code of UnifiedCache in metadata mode "
            "(every decision, no payload bytes) and report prefix hit ratios. One tier: "
            "--capacity-tokens (a comma list sweeps capacities). Two tiers: --dram and --nvme "
            "(DRAM over NVMe; hits and bytes written are reported per tier). Every policy "
            "named runs at every capacity, one replay at a time."),
        epilog=(
            "Output: a table, or with --json one JSON object per replay with policy, tiers, "
            "capacity_tokens (one tier) or dram_tokens/nvme_tokens, hit_ratio (block "
            "occurrences), token_hit_ratio, dram_hits, nvme_hits, misses, nvme_bytes_written, "
            "dram_bytes_written, promotions, demotions, evictions, refused and "
            "prefill_saved_ratio. Cost model: a hit saves prefill_ms_per_token x tokens of "
            "the block minus block_bytes / tier bandwidth; the ratio is over the prefill time "
            "of the whole trace without a cache. Example: ucm bench trace --trace t.jsonl "
            "--policy all --capacity-tokens 1M,3M,10M --plot docs/trace_hit_ratio.png"),
        add_args=_add_args, handler=handle, raw_description=False)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="trace file, JSON Lines in the Mooncake format")
    p.add_argument("--policy", required=True, metavar="NAME[,NAME...]",
                   help=f"policy, a comma list of policies, or 'all' (the {POLICY_NAMESPACE!r} "
                        "entry points: lru, fifo, lfu, arc, s3fifo, tinylfu, heat, opt)")
    p.add_argument("--capacity-tokens", metavar="N[,N...]",
                   help="one tier of N tokens (suffixes K, M, G = 1e3, 1e6, 1e9), e.g. 1M, "
                        "or a list to sweep, e.g. 1M,3M,10M")
    p.add_argument("--dram", metavar="SIZE",
                   help="two tiers: DRAM size in tokens (e.g. 1M) or, ending in B, in bytes "
                        "(e.g. 64GiB)")
    p.add_argument("--nvme", metavar="SIZE", help="two tiers: NVMe size, as --dram")
    p.add_argument("--codec-ratio", type=float, default=1.0, metavar="R",
                   help="two tiers: the NVMe tier stores blocks R x smaller (a codec; ucm bench codec reports "
                        "R): equal bytes hold R x more blocks and a hit reads 1/R of the bytes (default 1)")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, metavar="B",
                   help=f"nominal KV bytes of one block (default {DEFAULT_BLOCK_BYTES} = 64 MiB: "
                        "512 tokens of a Llama-3-8B-class model, fp16)")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, metavar="N",
                   help=f"tokens per hash id in the trace (default {BLOCK_TOKENS})")
    p.add_argument("--prefill-ms-per-token", type=float, default=DEFAULT_PREFILL_MS_PER_TOKEN,
                   metavar="MS", help="cost model: recompute cost of one token "
                                      f"(default {DEFAULT_PREFILL_MS_PER_TOKEN})")
    p.add_argument("--dram-gbps", type=float, metavar="GBPS",
                   help="cost model: load bandwidth from DRAM, GB/s (default: from --io-json, "
                        f"else {DEFAULT_DRAM_GBPS})")
    p.add_argument("--nvme-gbps", type=float, metavar="GBPS",
                   help="cost model: load bandwidth from NVMe, GB/s (default: from --io-json, "
                        f"else {DEFAULT_NVME_GBPS})")
    p.add_argument("--io-json", metavar="FILE",
                   help="cost model: take dram_load_gbps and nvme_load_gbps from the saved "
                        "output of `ucm bench io --json`")
    p.add_argument("--limit", type=int, metavar="N",
                   help="replay only the first N requests of the trace")
    p.add_argument("--bytes", metavar="SIZE",
                   help="replay with real payloads of SIZE bytes per block (e.g. 64KiB) through "
                        "a UnifiedCache (dram adapter; nvme adapter in a temporary directory for "
                        "two tiers); each tier holds as many blocks as in metadata mode; every "
                        "hit is read back and checked (payload_mismatches must be 0)")
    p.add_argument("--live", action="store_true",
                   help="with --bytes: drive the cache through its public API in the vLLM connector's call "
                        "sequence (begin_request, lookup, pin, read_slots, chunked write_slots, finish; "
                        "ucm/bench/cache/live.py) instead of the placement directly")
    p.add_argument("--chunk-blocks", type=int, default=4, metavar="N",
                   help="with --live: blocks per write_slots call (a chunked-prefill step; default 4)")
    p.add_argument("--bytes-dir", metavar="DIR",
                   help="with --bytes: where the NVMe tier's temporary directory goes "
                        "(default: the system temporary directory)")
    add_json_flag(p, "print one JSON object per replay (JSON Lines) instead of a table")
    p.add_argument("--plot", metavar="OUT.png",
                   help="also plot hit ratio against --capacity-tokens, one line per policy")
