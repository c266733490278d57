"""Byte sizes written like `4GiB`, `512 MiB`, `1.5GB` or a plain integer."""
from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1 << 20,
    "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30,
    "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1 << 40,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ALLOWED = "an integer number of bytes, or a number with one of B, KB, KiB, MB, MiB, GB, GiB, TB, TiB"


def parse_size(value: Union[int, float, str]) -> int:
    """Returns the number of bytes; raises ValueError naming what is allowed."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}; use {ALLOWED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must be >= 0")
        return value
    if isinstance(value, float):
        if value < 0 or not value.is_integer():
            raise ValueError(f"invalid size {value!r}; use {ALLOWED}")
        return int(value)
    if isinstance(value, str):
        m = _RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n != float("inf"):  # hundreds of digits overflow the float: no size, not an OverflowError
                return int(n)
    raise ValueError(f"invalid size {value!r}; use {ALLOWED}")


def positive_size(value: Union[int, float, str]) -> int:
    """`parse_size`, refusing 0 (a capacity): the ValueError pydantic turns
    into the key's message."""
    n = parse_size(value)
    if n <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return n


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"
