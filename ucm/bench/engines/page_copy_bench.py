"""ucm bench pages: the vLLM worker's page copies between an engine's paged
KV tensors and ucm's DRAM, against plain copies of the same bytes.

The KV tensors are laid out as vLLM's FlashAttention backend lays them out,
per layer (2, pages, page tokens, KV heads, head size): a page's K and V
are two chunks far apart. A ucm block is `block_tokens / page_tokens`
pages of every layer. Each round copies `blocks` blocks whose pages are
scattered at random over the KV tensors, measured in GB/s of payload (10^9
bytes per second), the median of `rounds` after one round of warm-up:

- `memcpy_h2d`, `memcpy_d2h`: one contiguous copy of the same number of
  bytes between the registered arena and one device buffer (on the CPU: a
  memcpy between two host buffers), the most the link gives;
- `pageable_h2d`, `pageable_d2h`: the same from and to ordinary (not
  pinned) host memory: what a copy gets when the arena could not be
  registered (CUDA only);
- `copier_load`, `copier_save`: `TorchPageCopier` (the copier the worker
  uses for CUDA tensors) between an anonymous mmap registered as pinned
  memory and the scattered pages: one host-to-device copy per block into
  staging, then a scatter of the pages' chunks (a save: the reverse);
- `copier_load_1`, `copier_save_1`: the same, one block per call (the
  service's parts below are 16 MiB: one block of the default geometry);
- `service_load`, `service_save`: the same copier inside `read_slots` /
  `write_slots` of a client of `ucm serve` (the service started for the
  run, its DRAM tier the arena the worker maps), as vLLM's worker loads a
  DRAM hit and saves a request's blocks: slot leases and commits included.

The device is the first CUDA device (`--device auto`) or the CPU; on the
CPU the copier's code is the same, with no pinning or streams (vLLM for
CPU itself uses the native copier, `cpu_pages`, measured by `ucm bench
vllm`).
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from typing import Any, Callable

from ucm.bench import common
from ucm.errors import ArgumentError

GB = 1e9


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "pages", help="the vLLM worker's page copies to and from DRAM, against memcpy",
                     description=__doc__, add_args=_add_args, handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    common.add_device_flag(p)
    p.add_argument("--layers", type=int, default=32, help="layers (default 32, Llama-3-8B)")
    common.add_counts(p, kv_heads=(8, "KV heads"), head_size=(128, "head size"),
                      page_tokens=(16, "tokens per vLLM page"), block_tokens=(128, "tokens per ucm block"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    common.add_counts(p, blocks=(64, "blocks per round"), rounds=(5, "rounds; figures are medians"))
    common.add_json_flag(p)


def _check(args: argparse.Namespace) -> None:
    common.require_positive(args, ("layers", "kv_heads", "head_size", "page_tokens", "block_tokens", "blocks",
                                   "rounds"))
    if args.block_tokens % args.page_tokens:
        raise ArgumentError(f"--block-tokens ({args.block_tokens}) must be a multiple of --page-tokens "
                            f"({args.page_tokens})")


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def pages_bench(device: str = "auto", layers: int = 32, kv_heads: int = 8, head_size: int = 128,
                page_tokens: int = 16, block_tokens: int = 128, dtype: str = "bfloat16", blocks: int = 64,
                rounds: int = 5, seed: int = 0) -> dict:
    """Runs the bench (module docstring) and returns its figures."""
    import torch

    import ucm
    from ucm.api import Outcome
    from ucm.connectors.torch_pages import TorchPageCopier, page_views

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    cuda = dev.type == "cuda"
    tdtype = getattr(torch, dtype)
    ppb = block_tokens // page_tokens
    num_pages = 2 * blocks * ppb  # twice what a round touches: its pages are a random half
    g = torch.Generator().manual_seed(seed)  # the pages each round picks
    on_dev = torch.Generator(device=dev).manual_seed(seed)
    kv = [torch.randn((2, num_pages, page_tokens, kv_heads, head_size), generator=on_dev, device=dev).to(tdtype)
          for _ in range(layers)]
    strides = {f"layer{i}": t.stride(1) * t.element_size() for i, t in enumerate(kv)}  # as vLLM states them
    layouts, _, storages = page_views([(f"layer{i}", t) for i, t in enumerate(kv)], num_pages, strides)
    copier = TorchPageCopier(storages, layouts, ppb)
    bb = copier.block_bytes
    nbytes = blocks * bb

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def page_sets() -> list[list[int]]:
        perm = torch.randperm(num_pages, generator=g)[:blocks * ppb].tolist()
        return [perm[i * ppb:(i + 1) * ppb] for i in range(blocks)]

    arena = mmap.mmap(-1, nbytes)
    host_arena = torch.frombuffer(memoryview(arena), dtype=torch.uint8)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pageable = torch.empty(nbytes, dtype=torch.uint8)  # not pinned
    secs: dict[str, list[float]] = {}
    warm = [True]  # round 0 of each part is a warm-up (first touches, the service arena's registration)

    def add(name: str, s: float) -> None:
        if not warm[0]:
            secs.setdefault(name, []).append(s)

    for r in range(rounds + 1):
        warm[0] = r == 0
        add("memcpy_h2d", _timed(lambda: dev_buf.copy_(host_arena, non_blocking=True), sync))
        add("memcpy_d2h", _timed(lambda: host_arena.copy_(dev_buf, non_blocking=True), sync))
        if cuda:
            add("pageable_h2d", _timed(lambda: dev_buf.copy_(pageable), sync))
            add("pageable_d2h", _timed(lambda: pageable.copy_(dev_buf), sync))
        sets = page_sets()
        plan = [(i * bb, pages) for i, pages in enumerate(sets)]
        add("copier_save", _timed(lambda: copier.copy(True, plan, arena), sync))
        add("copier_load", _timed(lambda: copier.copy(False, plan, arena), sync))
        # One block per call, as the service's parts of 16 MiB (client_slots.PART_BYTES) call it.
        add("copier_save_1", _timed(lambda: [copier.copy(True, [b], arena) for b in plan], sync))
        add("copier_load_1", _timed(lambda: [copier.copy(False, [b], arena) for b in plan], sync))
    registered = cuda and copier.arenas_registered()
    copier.close()
    del host_arena
    arena.close()

    # Through the service: its DRAM tier is the arena; slots leased and committed per call.
    svc_copier = TorchPageCopier(storages, layouts, ppb)
    service: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-pages-") as tmp:
        cfg = {"block_tokens": block_tokens,
               "service": {"name": f"pages-{os.getpid()}", "socket": os.path.join(tmp, "ucm.sock")},
               "tiers": [{"adapter": "dram", "capacity": int(nbytes * (rounds + 1) * 1.25) + (64 << 20),
                          "options": {"prefault": True}}]}
        client = ucm.connect(cfg)
        try:
            for r in range(rounds + 1):
                warm[0] = r == 0
                keys = [os.urandom(16) for _ in range(blocks)]
                sets = page_sets()

                def fill(to_arena: bool) -> Callable[[int, list, Any], None]:
                    def f(first: int, slots: list, arena_: Any) -> None:
                        svc_copier.copy(to_arena, [(s[0], sets[first + i]) for i, s in enumerate(slots)
                                                   if s is not None], arena_)
                    return f

                out: list = []
                add("service_save", _timed(lambda: out.extend(client.write_slots(keys, [bb] * blocks,
                                                                                 fill(True))), sync))
                got: list = []
                add("service_load", _timed(lambda: got.extend(client.read_slots(keys, [bb] * blocks,
                                                                                fill(False))), sync))
                if out != [Outcome.DONE] * blocks or got != [Outcome.DONE] * blocks:
                    raise RuntimeError(f"round {r}: the service stored {out.count(Outcome.DONE)} and loaded "
                                       f"{got.count(Outcome.DONE)} of {blocks} blocks")
            service["registered"] = cuda and svc_copier.arenas_registered()
        finally:
            svc_copier.close()
            client.close()

    gbps = {k: round(nbytes / statistics.median(v) / GB, 2) for k, v in secs.items()}
    return {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "geometry": {"layers": layers, "kv_heads": kv_heads, "head_size": head_size, "page_tokens": page_tokens,
                     "block_tokens": block_tokens, "dtype": dtype, "layout": "flash_attn (2, pages, N, H, D)"},
        "block_bytes": bb, "blocks": blocks, "bytes_per_round": nbytes, "rounds": rounds,
        "arena_registered": registered, "service_arena_registered": service.get("registered", False),
        "gbps": gbps,
        "copier_vs_memcpy": {"load": round(gbps["copier_load"] / gbps["memcpy_h2d"], 3),
                             "save": round(gbps["copier_save"] / gbps["memcpy_d2h"], 3)},
        "seconds": secs,
    }


def _table(res: dict) -> str:
    lines = [f"{res['device']}, torch {res['torch']}: {res['blocks']} blocks of {res['block_bytes']} bytes per "
             f"round, {res['rounds']} rounds (arena pinned: {res['arena_registered']}; the service's: "
             f"{res['service_arena_registered']})", f"{'copy':<16}{'GB/s':>10}"]
    lines += [f"{k:<16}{v:>10.2f}" for k, v in res["gbps"].items()]
    lines.append(f"copier / memcpy: load {res['copier_vs_memcpy']['load']:.3f}, "
                 f"save {res['copier_vs_memcpy']['save']:.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    _check(args)
    res = pages_bench(args.device, args.layers, args.kv_heads, args.head_size, args.page_tokens,
                      args.block_tokens, args.dtype, args.blocks, args.rounds)
    common.report(res, args.json, _table, sort_keys=True)
    return 0
