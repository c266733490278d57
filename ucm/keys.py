"""Block identity: namespace digests and chained 16-byte block keys.

A block is `block_tokens` consecutive tokens of one prompt for one model
shard. Keys are stable across processes, restarts and machines (NVMe and
cluster tiers find blocks again by them), so their format is fixed here and
pinned by golden vectors in tests/unit/test_keys.py and cpp/tests/test_core.cpp.

Key format (computed in ucm._native, `chain_keys`)
    key_{-1} = seed: Namespace.digest(), or any 16-byte key to continue from
    key_i    = XXH3-128(key_{i-1} || tokens of block i)
Tokens are hashed as little-endian uint32, 4 bytes each; only full blocks are
keyed (a partial last block has no key). XXH3-128 runs with seed 0 and its
16 bytes are written in xxHash's canonical order (high 64 bits first, each
half big-endian): `_native.digest128(b"")` is 99aa06d3014798d86001c324468d497f.

Namespace digest (DIGEST_VERSION 2)
    digest = XXH3-128(canonical_bytes), canonical as above, where
    canonical_bytes = b"ucm.namespace" || u8 DIGEST_VERSION || u8 field count
                      || for each (name, kind) of DIGEST_FIELDS, in order:
                         u8 len(name) || name (ASCII) || kind (b"s" or b"i")
                         || value: "s" u32 LE byte length || UTF-8 bytes,
                                   "i" int64 LE (two's complement)
Every field of Namespace is in DIGEST_FIELDS, in declaration order; adding,
removing, renaming or reordering one is a format change (bump DIGEST_VERSION;
the tests fail until DIGEST_FIELDS matches the dataclass). Version 1 hashed
the JSON of the fields; its keys are simply not found by version 2.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from ucm import _native
from ucm.errors import ArgumentError

Key = bytes
KEY_BYTES = 16
LAYOUT_VERSION = 1
DIGEST_VERSION = 2
_DIGEST_TAG = b"ucm.namespace"

# (field, kind) in encoding order: "s" UTF-8 text, "i" int64. See the module docstring.
DIGEST_FIELDS: tuple[tuple[str, str], ...] = (
    ("model", "s"), ("kv_dtype", "s"), ("num_layers", "i"), ("num_kv_heads", "i"), ("head_size", "i"),
    ("block_tokens", "i"), ("tp_rank", "i"), ("tp_size", "i"), ("layout", "s"), ("layout_version", "i"),
    ("salt", "s"),
)
_INT64 = (-(1 << 63), (1 << 63) - 1)

_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "int8", "uint8")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes the bytes of a block. Equal namespaces share
    blocks; a changed namespace can never return foreign bytes."""

    model: str  # model name or weight fingerprint
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = ""  # engine/backend layout id, e.g. "vllm-cpu-LBHNC"
    layout_version: int = LAYOUT_VERSION
    salt: str = ""  # tenant, LoRA adapter, cache_salt, multimodal extras

    def __post_init__(self) -> None:
        for name, kind in DIGEST_FIELDS:
            v = getattr(self, name)
            if kind == "s" and not isinstance(v, str):
                raise ArgumentError(f"Namespace.{name} must be a str, got {v!r}")
            if kind == "i" and (not isinstance(v, int) or isinstance(v, bool) or not _INT64[0] <= v <= _INT64[1]):
                raise ArgumentError(f"Namespace.{name} must be an int in [-2**63, 2**63), got {v!r}")
        if not self.model:
            raise ArgumentError("Namespace.model must be a non-empty string")
        if self.kv_dtype not in _DTYPES:
            raise ArgumentError(f"Namespace.kv_dtype {self.kv_dtype!r} not one of {list(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_tokens", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ArgumentError(f"Namespace.{name} must be a positive int, got {v!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ArgumentError(f"Namespace.tp_rank must be in 0..{self.tp_size - 1}, got {self.tp_rank!r}")

    def canonical_bytes(self) -> bytes:
        """The bytes digest() hashes: every field in DIGEST_FIELDS order, typed
        and length-prefixed (format in the module docstring)."""
        out = [_DIGEST_TAG, bytes((DIGEST_VERSION, len(DIGEST_FIELDS)))]
        for name, kind in DIGEST_FIELDS:
            v = getattr(self, name)
            out += [bytes((len(name),)), name.encode("ascii"), kind.encode("ascii")]
            if kind == "s":
                b = v.encode("utf-8")
                out += [struct.pack("<I", len(b)), b]
            else:
                out.append(struct.pack("<q", v))
        return b"".join(out)

    def digest(self) -> Key:
        """16-byte XXH3-128 digest of canonical_bytes(): the seed of the
        namespace's block keys."""
        return _native.digest128(self.canonical_bytes())


def _as_tokens(tokens: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ArgumentError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return np.ascontiguousarray(arr)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > 0xFFFFFFFF:
        raise ArgumentError(f"token ids must be in 0..2**32-1, got range [{lo}, {hi}]")
    return arr.astype(np.uint32)


def block_keys(seed: Union[Namespace, Key], tokens: Union[Sequence[int], np.ndarray],
               block_tokens: Optional[int] = None) -> list[Key]:
    """Keys of the full blocks of `tokens`, chained from `seed` (a Namespace,
    or a 16-byte namespace digest / the key of the block before `tokens`).
    `block_tokens` defaults to the namespace's."""
    if isinstance(seed, Namespace):
        bt = seed.block_tokens if block_tokens is None else block_tokens
        seed_bytes = seed.digest()
    else:
        if block_tokens is None:
            raise ArgumentError("block_tokens is required when seed is a digest")
        bt = block_tokens
        seed_bytes = bytes(seed)
    if len(seed_bytes) != KEY_BYTES:
        raise ArgumentError(f"seed must be {KEY_BYTES} bytes, got {len(seed_bytes)}")
    if not isinstance(bt, int) or bt <= 0:
        raise ArgumentError(f"block_tokens must be a positive int, got {bt!r}")
    raw = _native.chain_keys(seed_bytes, _as_tokens(tokens), bt)
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
