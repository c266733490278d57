"""What every `ucm bench NAME` command does the same way: registering its
subcommand (and running as `python -m ...`), the flags all benches spell
alike, where its progress lines go, how it reports and how it fails.

- progress lines go to stderr under `--json` (stdout then carries the one
  JSON object and nothing else), to stdout otherwise;
- the result is printed once: `json.dumps(result)` under `--json`, else the
  bench's own table;
- an expected failure (a bad workload, an engine run that failed) prints
  `ucm bench NAME: message` on stderr and exits 1; misuse raises
  `ArgumentError`, which `ucm.cli` reports.

Pure argparse and printing, no engine; runs in the bench's own thread.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from ucm.errors import ArgumentError

Log = Callable[..., None]
Handler = Callable[[argparse.Namespace], int]
AddArgs = Callable[[argparse.ArgumentParser], None]


class Subparsers(Protocol):
    """What a bench's `register(sub)` needs of the `ucm bench` subparsers."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


# ---- the parser ------------------------------------------------------------------
def add_bench(sub: Subparsers, name: str, *, help: str, description: str, handler: Handler,
              add_args: Optional[AddArgs] = None, epilog: Optional[str] = None,
              raw_description: bool = True) -> argparse.ArgumentParser:
    """The `ucm bench NAME` subcommand: its help line, its description
    (the module docstring, kept as written unless `raw_description` is
    False), its flags (`add_args`) and the handler that runs it."""
    extra: dict[str, Any] = {"formatter_class": argparse.RawDescriptionHelpFormatter} if raw_description else {}
    p = sub.add_parser(name, help=help, description=description, epilog=epilog, **extra)
    if add_args is not None:
        add_args(p)
    p.set_defaults(handler=handler)
    return p


def main(prog: str, description: str, add_args: AddArgs, handler: Handler,
         argv: Optional[Sequence[str]] = None) -> int:
    """A bench run as `python -m <module>`: the same flags and handler as
    its `ucm bench` subcommand; the exit status."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return handler(ap.parse_args(argv))


def add_json_flag(p: argparse.ArgumentParser, help: str = "print one JSON object") -> None:
    p.add_argument("--json", action="store_true", help=help)


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model prepared with `ucm model prepare` (default smollm2)")


def add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (the first CUDA device, else cpu), cpu, cuda, cuda:N")


def add_counts(p: argparse.ArgumentParser, **counts: tuple[int, str]) -> None:
    """Integer flags, `name=(default, what)` each: `--name` (underscores
    become dashes) with the help `what (default N)`."""
    for name, (default, what) in counts.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"{what} (default {default})")


def require_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Raises ArgumentError naming the first flag of `names` that is not > 0."""
    for key in names:
        if getattr(args, key) <= 0:
            raise ArgumentError(f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")


# ---- the run and its output ------------------------------------------------------
def progress_log(json_out: bool) -> Log:
    """Where progress lines go: stderr under `--json`, else stdout."""
    if json_out:
        return lambda *a: print(*a, file=sys.stderr, flush=True)
    return print


def report(result: Any, json_out: bool, table: Callable[[Any], str], **json_kw: Any) -> None:
    """The result, once: one JSON object under `--json`, else `table(result)`."""
    print(json.dumps(result, **json_kw) if json_out else table(result))


def run_measured(args: argparse.Namespace, name: str, measure: Callable[[Log], Any],
                 table: Callable[[Any], str], errors: tuple[type[BaseException], ...] = (ValueError,),
                 **json_kw: Any) -> int:
    """`measure(log)`, then its report; one of `errors` is printed as
    `ucm bench NAME: message` and exits 1."""
    log = progress_log(args.json)
    try:
        result = measure(log)
    except errors as e:
        print(f"ucm bench {name}: {e}", file=sys.stderr)
        return 1
    report(result, args.json, table, **json_kw)
    return 0


def key_values(result: dict[str, Any], width: int, skip: Iterable[str] = ()) -> str:
    """`key value` lines, keys sorted and padded to `width`."""
    left_out = set(skip)
    return "\n".join(f"{k:{width}s} {result[k]}" for k in sorted(result) if k not in left_out)


# ---- figures ---------------------------------------------------------------------
def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 bytes per second), 3 decimals; inf for no time."""
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def nearest_rank(xs: Iterable[float], q: float) -> float:
    """The sample at rank `q` (0..1) of the sorted samples, not interpolated."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
