"""Block identity: namespace digests and chained 16-byte block keys.

A block is `block_tokens` consecutive tokens of one prompt for one model
shard. Its key is `key_i = XXH3-128(key_{i-1} || tokens_i)`, seeded with the
digest of the namespace, computed in ucm._native (tokens hashed as
little-endian uint32). Keys are stable across processes, restarts and
machines; only full blocks are keyed.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import numpy as np

from ucm import _native
from ucm.errors import ArgumentError

Key = bytes
KEY_BYTES = 16
LAYOUT_VERSION = 1

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

    def digest(self) -> Key:
        """16-byte digest of the canonical JSON form of every field."""
        canon = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return _native.digest128(canon)


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
