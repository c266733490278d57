"""Seeded random inputs and byte mutations for the fuzz tests.

Each test draws from its own `random.Random`, seeded from the test's name
and `UCMFUZZ_SEED` (default 0), so a CI run is reproducible and a failure
message's seed replays it. `UCMFUZZ_EXAMPLES=N` runs N examples per test
instead of the modest CI default, for long runs by hand:

    UCMFUZZ_EXAMPLES=200000 UCMFUZZ_SEED=$RANDOM pytest -q tests/fuzz

(Not UCM_...: those are config overrides. hypothesis and atheris are not installed in this project's environment;
plain seeded generators keep the tests dependency-free.)
"""
from __future__ import annotations

import math
import os
import random
import struct
from typing import Any

SEED = int(os.environ.get("UCMFUZZ_SEED", "0"))


def examples(default: int) -> int:
    """Examples to run: `UCMFUZZ_EXAMPLES` when set, else `default`."""
    v = os.environ.get("UCMFUZZ_EXAMPLES")
    return int(v) if v else default


def rng(name: str) -> random.Random:
    return random.Random(f"{SEED}:{name}")


# Values that sit on boundaries the code under test checks.
INTS = [0, 1, -1, 2, 15, 16, 17, 255, 256, 4095, 4096, 65535, 65536, 1 << 20, (1 << 31) - 1, 1 << 31,
        (1 << 32) - 1, 1 << 32, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1]
FLOATS = [0.0, -0.0, 0.5, 1.5, -1.0, 1e300, -1e300, 1e-300, math.inf, -math.inf, math.nan]
STRINGS = ["", " ", "0", "-1", "1e9", "4GiB", "4 GiB", "0B", "-4GiB", "1.5GB", "9" * 400 + "GiB", "nan",
           "inf", "none", "null", "true", "~", "..", "../..", "/", "a/b", "%", "5%", "150%", "\x00",
           "\udcff", "é", "x" * 70, "lru", "dram", "nvme", "fs", "heat", "{}", "[]", "!!python/object:os.system"]
INTERESTING_BYTES = [0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xc1, 0xc4, 0xd9, 0xdc, 0xdd, 0xde, 0xdf,
                     0x90, 0x9f, 0x80, 0x8f, 0xa0, 0xbf, 0xcf, 0xd3, 0xc7, 0xc8, 0xc9, 0xd4, 0xd8]


def scalar(rnd: random.Random) -> Any:
    r = rnd.random()
    if r < 0.25:
        return rnd.choice(INTS) + rnd.choice((0, 0, 0, 1, -1))
    if r < 0.35:
        return rnd.choice(FLOATS)
    if r < 0.6:
        return rnd.choice(STRINGS)
    if r < 0.7:
        return rnd.choice((None, True, False))
    if r < 0.85:
        return rnd.randbytes(rnd.choice((0, 1, 15, 16, 16, 16, 17, 32)))
    return "".join(chr(rnd.randrange(32, 0x2000)) for _ in range(rnd.randrange(0, 12)))


def value(rnd: random.Random, depth: int = 3, binary: bool = True) -> Any:
    """A random nest of lists, maps and scalars (bytes only when `binary`)."""
    r = rnd.random()
    if depth <= 0 or r < 0.55:
        v = scalar(rnd)
        return v if binary or not isinstance(v, bytes) else v.hex()
    if r < 0.8:
        return [value(rnd, depth - 1, binary) for _ in range(rnd.randrange(0, 5))]
    keys = [rnd.choice(STRINGS[:20]) if rnd.random() < 0.5 else f"k{rnd.randrange(100)}"
            for _ in range(rnd.randrange(0, 5))]
    return {k: value(rnd, depth - 1, binary) for k in keys}


def mutate(rnd: random.Random, data: bytes, rounds: int = 0) -> bytes:
    """`data` with 1-4 random edits (bit flips, interesting bytes, inserted,
    deleted, duplicated or truncated runs, 32-bit length fields)."""
    buf = bytearray(data)
    for _ in range(rounds or rnd.randint(1, 4)):
        op = rnd.randrange(8)
        pos = rnd.randrange(len(buf) + 1)
        if op == 0 and buf:
            i = rnd.randrange(len(buf))
            buf[i] ^= 1 << rnd.randrange(8)
        elif op == 1 and buf:
            buf[rnd.randrange(len(buf))] = rnd.choice(INTERESTING_BYTES)
        elif op == 2:
            buf[pos:pos] = rnd.randbytes(rnd.randrange(1, 9))
        elif op == 3 and buf:
            del buf[pos:pos + rnd.randrange(1, 9)]
        elif op == 4 and buf:
            j = rnd.randrange(len(buf))
            buf[pos:pos] = buf[j:j + rnd.randrange(1, 17)]
        elif op == 5:
            del buf[pos:]
        elif op == 6:
            buf[pos:pos + 4] = struct.pack("<I", rnd.choice(INTS) & 0xFFFFFFFF)
        else:
            buf[pos:pos] = bytes([rnd.choice(INTERESTING_BYTES)]) * rnd.randrange(1, 40)
    return bytes(buf)


def chunks(rnd: random.Random, data: bytes) -> list[bytes]:
    """`data` cut at random places (how a stream socket may deliver it)."""
    out, i = [], 0
    while i < len(data):
        n = rnd.choice((1, 2, 3, 4, 5, 7, 64, 4096, len(data)))
        out.append(data[i:i + n])
        i += n
    return out
