"""The block namespace and payload layout of a transformers model.

Everything that changes the bytes of a block goes into `ucm.keys.Namespace`:
the model's identity (a fingerprint of its weights and effective config,
`ucm.connectors.identity`, unless an explicit id is given), the KV dtype,
layers, KV heads, head size, block tokens, and a layout string naming the
payload layout, the device type and the attention implementation (both
change the numerics of every layer after the first, so a block computed
under `eager` is not handed to an `sdpa` model).

Payload (layout "LKVHTD", version 1): one block is, for each layer in
order, that layer's K then V of the block's tokens, each `[kv_heads,
block_tokens, head_dim]` contiguous in the model's dtype: a
`[layers, 2, kv_heads, block_tokens, head_dim]` tensor viewed as bytes. One
layer of a block is one contiguous range (`layer_bytes` at
`layer * layer_bytes`), as the design asks of every layout.

Only models whose every layer is full attention with a `DynamicLayer`-style
cache are supported (sliding windows and linear attention keep state that
a prefix of blocks does not describe): anything else is a ConfigError at
construction. Runs once, in the caller's thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ucm.codecs.layout import KvLayout, planar_layout
from ucm.connectors.identity import model_fingerprint
from ucm.errors import ConfigError
from ucm.keys import Namespace

LAYOUT = "LKVHTD"
KV_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape of one block's payload: `[num_layers, 2, num_kv_heads,
    block_tokens, head_dim]` of `dtype` (a torch dtype name)."""

    num_layers: int
    num_kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_tokens * self.head_dim * _ELEM_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def kv_layout(self) -> KvLayout:
        """Which bytes are K and V, for the codecs of the tiers below DRAM."""
        return planar_layout(self.dtype, self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim)


def text_config(model: Any) -> Any:
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of `model`, checked to be full attention
    in every layer."""
    cfg = text_config(model)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ConfigError(f"transformers connector: encoder-decoder models ({cfg.model_type}) are not supported")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"transformers connector: every layer must be full attention, got layer types "
                          f"{sorted(set(layer_types))}")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and not layer_types:
        raise ConfigError(f"transformers connector: sliding-window attention ({cfg.sliding_window}) is not supported")
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return layers, kv_heads, head_dim


def kv_dtype(model: Any) -> str:
    name = str(model.dtype).removeprefix("torch.")
    if name not in KV_DTYPES:
        raise ConfigError(f"transformers connector: model dtype {name!r} is not supported; allowed: {sorted(KV_DTYPES)}")
    return KV_DTYPES[name]


def model_identity(model: Any) -> str:
    """A fingerprint of the weights behind `model` (its `name_or_path`:
    a local directory, or a hub id found in the local Hugging Face cache)
    with its effective config and dtype; the path itself is a label."""
    cfg = model.config
    path = getattr(model, "name_or_path", None) or getattr(cfg, "_name_or_path", None)
    if not path:
        raise ConfigError("transformers connector: the model names no weights (name_or_path is empty: built from a "
                          "config?); give model_id")
    extra = {"engine": "transformers", "class": type(model).__name__, "dtype": kv_dtype(model),
             "quantization": (cfg.to_dict().get("quantization_config") or None)}
    fp = model_fingerprint(path,
                           revision=getattr(cfg, "_commit_hash", None), config=cfg.to_dict(), extra=extra)
    return f"weights:{fp.digest}"


def attn_implementation(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def build_namespace(model: Any, block_tokens: int, model_id: Optional[str] = None,
                    salt: str = "") -> tuple[Namespace, BlockLayout]:
    """The namespace of `model`'s blocks and their payload layout."""
    layers, kv_heads, head_dim = kv_shape(model)
    dtype = kv_dtype(model)
    ns = Namespace(model=model_id or model_identity(model), kv_dtype=dtype, num_layers=layers,
                   num_kv_heads=kv_heads, head_size=head_dim, block_tokens=block_tokens,
                   layout=f"hf-{model.device.type}-{attn_implementation(model)}-{LAYOUT}", salt=salt)
    return ns, BlockLayout(layers, kv_heads, block_tokens, head_dim, dtype)
