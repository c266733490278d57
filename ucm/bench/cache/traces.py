"""Reading request traces in the Mooncake format.

One JSON object per line: `timestamp` (ms, a number), `input_length`
(tokens, an int), optional `output_length` (tokens, an int), and `hash_ids`
(one non-negative int per `block_tokens`-token block of the input; ids are
chained, so an equal id means an equal prefix up to and including that
block). Blank lines are skipped. A malformed line raises `TraceError` naming
its line number; nothing is guessed.

Pure parsing: no placement, no I/O besides reading the file.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Union

from ucm.errors import TraceError

log = logging.getLogger(__name__)

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace format
MAX_HASH_ID = (1 << 64) - 1  # ids become 8-byte block keys


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # 1-based line number in the file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_tokens: int = BLOCK_TOKENS) -> list[int]:
        """Tokens in each block: full blocks, then whatever the input length
        leaves for the last one (at least 1, at most `block_tokens`)."""
        n = len(self.hash_ids)
        if n == 0:
            return []
        last = self.input_length - block_tokens * (n - 1)
        return [block_tokens] * (n - 1) + [min(block_tokens, max(1, last))]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, line: int) -> TraceRequest:
    """One trace line -> TraceRequest; TraceError naming `line` if malformed."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an int past sys.get_int_max_str_digits(); deep nesting
        raise TraceError(f"line {line}: not a trace record ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {line}: expected a JSON object, got {type(obj).__name__}")
    for name in ("timestamp", "input_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"line {line}: missing field {name!r} "
                             f"(required: timestamp, input_length, hash_ids)")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise TraceError(f"line {line}: 'timestamp' must be a finite number, got {ts!r}")
    length = obj["input_length"]
    if not _is_int(length) or length < 0:
        raise TraceError(f"line {line}: 'input_length' must be an int >= 0, got {length!r}")
    out = obj.get("output_length", 0)
    if not _is_int(out) or out < 0:
        raise TraceError(f"line {line}: 'output_length' must be an int >= 0, got {out!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"line {line}: 'hash_ids' must be a list of ints >= 0, "
                         f"got {type(ids).__name__}")
    seen: dict[int, int] = {}
    for pos, h in enumerate(ids):
        if not _is_int(h) or not 0 <= h <= MAX_HASH_ID:
            raise TraceError(f"line {line}: hash_ids[{pos}] must be an int in 0..2**64-1, "
                             f"got {h!r}")
        if h in seen:
            raise TraceError(f"line {line}: hash_ids repeats id {h} at positions {seen[h]} and "
                             f"{pos}; ids are chained prefix hashes, so one occurs once a request")
        seen[h] = pos
    return TraceRequest(line, float(ts), length, out, tuple(ids))


def iter_trace(lines: Iterable[str]) -> Iterator[TraceRequest]:
    """Parses trace lines (numbered from 1), skipping blank ones."""
    for n, text in enumerate(lines, start=1):
        if text.strip():
            yield parse_line(text, n)


def read_trace(path: Union[str, Path], block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Reads a whole trace file; TraceError for a missing file or a bad line."""
    p = Path(path)
    try:
        with p.open("r", encoding="utf-8") as f:
            requests = list(iter_trace(f))
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(p)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"trace {str(p)!r} is not UTF-8 text: {exc.reason}") from None
    off = sum(1 for r in requests
              if len(r.hash_ids) != -(-r.input_length // block_tokens))
    if off:
        log.warning("%s: %d of %d requests have len(hash_ids) != ceil(input_length / %d); "
                    "token counts of their last block are approximate", p, off, len(requests),
                    block_tokens)
    return requests
