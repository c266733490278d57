"""The block namespace of an SGLang HiCache host pool, and SGLang page keys
as ucm block keys.

SGLang's storage keys hash tokens only (a SHA-256 chain over each page's
token ids, seeded by `extra_key` / `cache_salt`): nothing in them says
which model, KV dtype, host layout or TP/PP shard the bytes belong to. So
every SGLang page key is mapped to a ucm block key under the namespace of
the pool that wrote it:

    ucm_key = XXH3-128(namespace digest || UTF-8 bytes of SGLang's key)

The namespace holds the model's identity (a fingerprint of the weights,
`identity.model_fingerprint`), the KV dtype, layers, KV heads, head size,
the page size (one ucm block is one SGLang page), TP rank and size, and the
host layout, PP stage and layer range in `layout`: the same tokens under
another model, dtype, layout or shard never hit. SGLang's own chain already
makes a page's key depend on every earlier token, so keys are not chained
again; the parent of a page is the previous page's ucm key (the parent
chain the placement policy keeps).

Pure functions; `build_namespace` runs once per backend, at registration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ucm import _native
from ucm.connectors.identity import model_fingerprint
from ucm.errors import ConfigError
from ucm.keys import Key, Namespace

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KV_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
             "float8_e4m3fn": "float8_e4m3", "float8_e5m2": "float8_e5m2", "uint8": "uint8"}


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What of an SGLang MHA host pool changes the bytes of a page."""

    kv_dtype: str  # torch dtype name without "torch."
    num_layers: int  # layers this pool holds (its PP stage's)
    num_kv_heads: int  # per TP rank
    head_size: int
    page_size: int  # tokens per SGLang page = per ucm block
    layout: str  # layer_first | page_first | page_first_direct
    start_layer: int = 0

    @classmethod
    def of_host_pool(cls, pool: Any) -> "PoolGeometry":
        """The geometry of SGLang's `MHATokenToKVPoolHost` `pool`; refuses
        pools whose pages ucm cannot copy verbatim (other layouts, K and V
        of different widths)."""
        layout = getattr(pool, "layout", None)
        if layout not in LAYOUTS:
            raise ConfigError(f"UCMStorage: host pool layout {layout!r} is not supported; allowed: {list(LAYOUTS)}")
        v_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_dim != pool.head_dim:
            raise ConfigError(f"UCMStorage: K and V head sizes differ ({pool.head_dim} and {v_dim}); "
                              f"only MHA pools with equal K and V widths are supported")
        return cls(kv_dtype=str(pool.dtype).removeprefix("torch."), num_layers=int(pool.layer_num),
                   num_kv_heads=int(pool.head_num), head_size=int(pool.head_dim), page_size=int(pool.page_size),
                   layout=layout, start_layer=int(getattr(pool, "start_layer", 0) or 0))


def model_identity(model_path: str, revision: Optional[str] = None, dtype: Optional[str] = None,
                   quantization: Optional[str] = None) -> str:
    """The model part of the namespace: a fingerprint of the weights at
    `model_path` (a directory, a file or a hub id found in the local cache)
    with SGLang's compute dtype and quantization; a served name is a label,
    not part of it."""
    extra = {"engine": "sglang", "dtype": dtype, "quantization": quantization}
    return f"weights:{model_fingerprint(model_path, revision=revision, extra=extra).digest}"


def build_namespace(geometry: PoolGeometry, model_id: str, tp_rank: int = 0, tp_size: int = 1,
                    pp_rank: int = 0, pp_size: int = 1) -> Namespace:
    """The namespace of the pages of one host pool (see the module doc)."""
    if geometry.kv_dtype not in KV_DTYPES:
        raise ConfigError(f"UCMStorage: KV dtype {geometry.kv_dtype!r} is not supported; allowed: {sorted(KV_DTYPES)}")
    layout = (f"sglang-{geometry.layout}-page{geometry.page_size}-pp{pp_rank}of{pp_size}"
              f"-layers{geometry.start_layer}+{geometry.num_layers}")
    return Namespace(model=model_id, kv_dtype=KV_DTYPES[geometry.kv_dtype], num_layers=geometry.num_layers,
                     num_kv_heads=geometry.num_kv_heads, head_size=geometry.head_size,
                     block_tokens=geometry.page_size, tp_rank=tp_rank, tp_size=tp_size, layout=layout)


def page_keys(seed: Key, sglang_keys: Sequence[str]) -> list[Key]:
    """ucm block keys of SGLang page keys under the namespace digest `seed`."""
    return [_native.digest128(seed + k.encode()) for k in sglang_keys]
