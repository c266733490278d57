"""Low-rank keys: a per-token summary that scores tokens, not pages (Loki).

Keys of a layer and KV head concentrate in a few directions. `KeyBasis`
holds, per layer and KV head, the `rank` leading right singular vectors of
a sample of keys (`fit_key_basis`: the keys themselves, not centred, so
`q . k` is approximated by `(q P) . (k P)`); a block's summary then keeps
every token's projected key `k P` (`rank` floats per token, layer and
head, kept as float16: summaries.py). At a decode step the `lowrank` selector
(selectors.py) projects the query once per layer, approximates every
context token's logit from the projections, and ranks pages by their
approximate attention mass: the oracle's rule over approximate keys.

Why (measured in docs/lab/benchmarks.md, "the `lowrank` selector"): a few
leading directions hold a head's attention mass closer to the oracle's
than page summaries do, and a basis fitted on another document does as
well as the document's own; decoding needs a higher rank than mass
estimation (the tokens a low rank misses are the ones a head needed), and
it can lose a single needle that quest's bound keeps, hence the
connectors' default `hybrid` (selectors.py). Cost: `rank x 2` bytes per
token, layer and KV head (`store_projections`: float16, clamped to its
finite range), rank / (2 x head_dim) of a bfloat16 block's K and V.
float16's rounding (a relative 2^-11 per projection) is far below what the
rank leaves out.

The basis is part of what a projection means: a summary records the
digest of the basis it was made with (`KeyBasis.digest`), and projections
made with another basis are not used together (summaries.layer_units).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ucm.accelerators.sparse.mass import grouped, token_mass
from ucm.errors import ArgumentError

PROJ_DTYPE = np.dtype(np.float16)  # how summaries keep projected keys
_PROJ_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True, slots=True, eq=False)
class KeyBasis:
    """`vectors` `[layers, kv_heads, head_dim, rank]` float32, orthonormal
    columns per layer and head."""

    vectors: np.ndarray
    digest: bytes = field(init=False)

    def __post_init__(self) -> None:
        v = self.vectors
        if not isinstance(v, np.ndarray) or v.ndim != 4 or v.dtype != np.float32 or not 0 < v.shape[3] <= v.shape[2]:
            raise ArgumentError(f"KeyBasis.vectors must be a float32 [layers, kv_heads, head_dim, rank] array with "
                                f"0 < rank <= head_dim, got {getattr(v, 'shape', type(v).__name__)} "
                                f"{getattr(v, 'dtype', '')}")
        object.__setattr__(self, "digest", hashlib.blake2b(np.ascontiguousarray(v).tobytes() + str(v.shape).encode(),
                                                           digest_size=16).digest())

    @property
    def rank(self) -> int:
        return self.vectors.shape[3]

    def project(self, keys: np.ndarray) -> np.ndarray:
        """`keys` `[layers, kv_heads, tokens, head_dim]` -> `[layers,
        kv_heads, tokens, rank]` float32."""
        if keys.ndim != 4 or keys.shape[0] != self.vectors.shape[0] or keys.shape[1] != self.vectors.shape[1] \
                or keys.shape[3] != self.vectors.shape[2]:
            raise ArgumentError(f"KeyBasis.project: keys {keys.shape} do not match the basis "
                                f"{self.vectors.shape[:3]} (layers, kv_heads, head_dim)")
        return np.einsum("lhtd,lhdr->lhtr", keys.astype(np.float32, copy=False), self.vectors,
                         optimize=True).astype(np.float32, copy=False)


def store_projections(proj: np.ndarray) -> np.ndarray:
    """Projected keys as summaries keep them: float16, values beyond its
    finite range clamped to it (a key that far along a direction is picked
    anyway; never an inf that would turn a softmax into NaN)."""
    return np.clip(proj, -_PROJ_MAX, _PROJ_MAX).astype(PROJ_DTYPE)


def fit_key_basis(layer_keys: Sequence[np.ndarray], rank: int) -> KeyBasis:
    """The basis of `rank` leading right singular vectors of each layer's
    keys `[kv_heads, n_tokens, head_dim]` (one array per layer, n_tokens >=
    rank), per KV head; each vector's largest component made positive, so
    the same keys give the same basis."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ArgumentError(f"fit_key_basis: rank must be an int > 0, got {rank!r}")
    if not layer_keys:
        raise ArgumentError("fit_key_basis: no keys")
    out = []
    for layer, k in enumerate(layer_keys):
        k = np.asarray(k)
        if k.ndim != 3 or k.shape[1] < rank or k.shape[2] < rank:
            raise ArgumentError(f"fit_key_basis: layer {layer} keys {k.shape} cannot give rank {rank} "
                                f"(need [kv_heads, n_tokens >= rank, head_dim >= rank])")
        _, _, vt = np.linalg.svd(k.astype(np.float64), full_matrices=False)  # [kv_heads, d, head_dim]
        v = vt[:, :rank, :]
        sign = np.sign(np.take_along_axis(v, np.abs(v).argmax(axis=2)[..., None], axis=2))
        sign[sign == 0] = 1.0
        out.append((v * sign).transpose(0, 2, 1))
    shapes = {x.shape for x in out}
    if len(shapes) != 1:
        raise ArgumentError(f"fit_key_basis: the layers' keys differ in heads or head_dim: {sorted(shapes)}")
    return KeyBasis(np.ascontiguousarray(np.stack(out), dtype=np.float32))


def lowrank_mass(query: np.ndarray, basis: np.ndarray, proj: np.ndarray, scale: float) -> np.ndarray:
    """The attention of `query` `[q_heads, head_dim]` per token, averaged
    over query heads, from one layer's `basis` `[kv_heads, head_dim, rank]`
    and projected keys `proj` `[kv_heads, n_tokens, rank]` (any float
    dtype; float32 arithmetic): `[n_tokens]`, summing to 1 (mass.token_mass
    over the keys `proj P^T`)."""
    if basis.ndim != 3 or proj.ndim != 3 or proj.shape[0] != basis.shape[0] or proj.shape[2] != basis.shape[2] \
            or basis.shape[1] != query.shape[1]:
        raise ArgumentError(f"lowrank_mass: query {query.shape}, basis {basis.shape} and projections {proj.shape} "
                            f"do not match")
    # each query head projected on its KV head's basis: then the true mass's rule over the projections
    qp = np.einsum("hgd,hdr->hgr", grouped(query, basis.shape[0]), basis, optimize=True)
    return token_mass(np.ascontiguousarray(qp.reshape(query.shape[0], -1), dtype=np.float32),
                      proj.astype(np.float32, copy=False), scale)
