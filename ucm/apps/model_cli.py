"""`ucm model prepare NAME`: build a local model directory once and print its path.

The path is the last line of the output so scripts can take it with
`tail -n1`. Registered into the top-level parser with `register(subparsers)`.
"""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from ucm.apps.model import MODELS

    model = subparsers.add_parser("model", help="prepare local model directories (offline)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prep = model_sub.add_parser(
        "prepare", help="build the model directory once (cached) and print its path as the last line")
    prep.add_argument("name", choices=sorted(MODELS), help="model to prepare")
    prep.add_argument("--cache-dir", default=None,
                      help="cache root (default: $UCM_MODEL_CACHE or ~/.cache/ucm/models)")
    prep.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from ucm.apps.model import prepare

    path = prepare(args.name, cache_dir=args.cache_dir)
    print(path, flush=True)
    return 0
