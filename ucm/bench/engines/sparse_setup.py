"""What both parts of `ucm bench sparse` (the offline replay in
sparse_bench.py, the closed loop in sparse_closed_loop.py) read from the
command line and load the same way: the budgets and their names, the
`--reselect-every` values (checked before any model loads), and the model
in float32 with the attention implementation each part needs.

Runs in the bench's thread; the model is loaded on the CPU.
"""
from __future__ import annotations

import argparse
from typing import Any

from ucm.errors import ArgumentError


def budgets_of(args: argparse.Namespace) -> list:
    """`--budgets` (extra tokens) then `--top-p` (adaptive) as `Budget`s."""
    from ucm.accelerators.sparse.base import Budget

    out = [Budget.tokens(int(b)) for b in args.budgets.split(",") if b]
    return out + [Budget.top_p(float(p)) for p in args.top_p.split(",") if p]


def reselect_every(args: argparse.Namespace) -> list[int]:
    """The `--reselect-every` values, each an int >= 1."""
    raw = getattr(args, "reselect_every", "1")
    try:
        out = [int(x) for x in str(raw).split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise ArgumentError(f"--reselect-every {raw!r}: expected comma-separated ints >= 1, e.g. 1,4")
    return out


def budget_name(b: Any) -> str:
    """A budget as the rows name it: `kind=value`."""
    return f"{b.kind}={b.value}"


def load_model(model_dir: str, attn: str, layers: int = 0) -> Any:
    """The model of `model_dir` in float32 with attention `attn`, in eval
    mode; `layers` > 0 keeps only the first ones (for tests)."""
    import torch
    from transformers import AutoModelForCausalLM

    extra = {"num_hidden_layers": layers} if layers else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn,
                                                **extra).eval()
