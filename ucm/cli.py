"""The `ucm` command line: serve, bench, inspect, model, pd-proxy.

Each benchmark lives in its own module (ucm/bench/cache/ for the cache's
own, ucm/bench/engines/ for those that drive an engine) and registers its subcommand with
`register(subparsers)`; its handler returns the exit status.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from ucm import __version__
from ucm.errors import UcmError

# `ucm bench NAME` -> the module that registers it
BENCHES = {name: f"ucm.bench.cache.{name}" for name in ("io", "placement", "service", "soak", "trace", "tracegen")}
BENCHES.update({name: f"ucm.bench.engines.{module}" for name, module in (
    ("vllm", "vllm_bench"), ("transformers", "transformers_bench"), ("sglang", "sglang_bench"),
    ("prefetch", "prefetch_bench"), ("codec", "codec_bench"), ("sparse", "sparse_bench"), ("pages", "page_copy_bench"),
    ("gpu-ttft", "gpu_ttft_bench"), ("route", "route_bench"), ("blend", "blend_bench"), ("pd", "pd_bench"))})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucm", description="Unified cache manager for LLM KV caches")
    parser.add_argument("--version", action="version", version=f"ucm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the cache service of this node")
    serve.add_argument("--config", default=None, help="YAML config (default: $UCM_CONFIG or built-in defaults)")
    serve.add_argument("--private", action="store_true",
                       help="exit once no client has been connected for --idle-exit-s (used by ucm.connect)")
    serve.add_argument("--idle-exit-s", type=float, default=5.0)
    serve.set_defaults(handler=_serve)
    inspect = sub.add_parser("inspect", help="show the state of a running service")
    inspect.add_argument("--config", default=None, help="config naming the service (its socket)")
    inspect.add_argument("--socket", default=None, help="socket path (overrides --config)")
    inspect.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    inspect.set_defaults(handler=_inspect)
    importlib.import_module("ucm.apps.model_cli").register(sub)
    importlib.import_module("ucm.apps.pd_proxy").register(sub)
    bench = sub.add_parser("bench", help="measure ucm against baselines from the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for module in BENCHES.values():
        importlib.import_module(module).register(bench_sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from ucm.config.schema import load_config
    from ucm.service.server.serve import serve

    return serve(load_config(args.config), private=args.private, idle_exit_s=args.idle_exit_s)


def _inspect(args: argparse.Namespace) -> int:
    import json

    from ucm.config.schema import load_config
    from ucm.service.client.cache_client import CacheClient
    from ucm.service.paths import socket_path

    cfg = load_config(args.config)
    path = args.socket or socket_path(cfg)
    client = CacheClient(path, cfg)
    try:
        stats = client.stats()
    finally:
        client.close()
    if not stats or stats.get("available") is False:
        print(f"ucm inspect: no service answers at {path}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, sort_keys=True, default=str))
        return 0
    from ucm.config.sizes import format_size

    svc = stats.get("service", {})
    print(f"service pid {svc.get('pid')}  socket {svc.get('socket')}  connections {svc.get('connections')}  "
          f"leases {svc.get('leases')}  metrics {svc.get('metrics') or 'off'}")
    head = ("tier", "blocks", "used", "capacity", "use%", "hits", "served", "inserts", "evictions", "written")
    rows = []
    for name, t in stats["tiers"].items():
        cap = t["capacity_bytes"] or 1
        rows.append((name, t["blocks"], format_size(t["used_bytes"]), format_size(t["capacity_bytes"]),
                     f"{100 * t['used_bytes'] / cap:.1f}", t["hits"], t.get("served_blocks", 0), t["inserts"],
                     t["evictions"], format_size(t["bytes_written"])))
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print("  ".join(str(v).rjust(w) for v, w in zip(r, widths)))
    print(f"lookups over the socket {stats['lookups']}  loaded {stats['loaded_blocks']} blocks "
          f"({format_size(stats['bytes_loaded'])})  missing {stats['missing_blocks']}  "
          f"stored {stats['stored_blocks']}  corrupt {stats['corrupt']}  failed {stats['failed']}  "
          f"evicted for headroom {stats.get('headroom_evictions', 0)}")
    accelerators = stats.get("accelerators") or {}
    if not accelerators:
        print("accelerators: none")
    for name, counts in accelerators.items():
        print(f"accelerator {name}: " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except UcmError as exc:
        print(f"ucm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
