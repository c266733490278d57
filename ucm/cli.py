"""The `ucm` command line: serve, bench, inspect, model.

Each benchmark lives in its own module under ucm/bench/ and registers its
subcommand with `register(subparsers)`; its handler returns the exit status.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

from ucm import __version__
from ucm.errors import UcmError

BENCHES = ("io", "trace")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucm", description="Unified cache manager for LLM KV caches")
    parser.add_argument("--version", action="version", version=f"ucm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="measure ucm against baselines from the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        importlib.import_module(f"ucm.bench.{name}").register(bench_sub)
    return parser


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
