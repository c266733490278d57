"""The block namespace of a vLLM engine: everything that changes the bytes
of a page (`ucm.keys.Namespace`): the model's identity (a fingerprint of its
weights unless set), KV dtype and shape, page size, platform and, off CPU,
vLLM's physical KV layout. Runs once, in the scheduler process, at
construction; the fingerprint reads the model's files."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ucm.connectors.identity import model_fingerprint
from ucm.errors import ConfigError
from ucm.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig

KV_DTYPES = {
    "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
    "float": "float32", "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2",
}


def model_identity(model_config: Any) -> str:
    """The model part of the block namespace for vLLM's `ModelConfig`: a
    fingerprint of the weights (`identity.model_fingerprint` over the model
    directory or file, vLLM's effective hf_config with its overrides, the
    revision and code revision, the quantization method, the compute dtype
    and, for weights pulled from object storage, their URI). The served
    name and the path are labels, not part of it: changed weights behind
    the same name or path get a new namespace."""
    mc = model_config
    extra = {"engine": "vllm", "dtype": str(mc.dtype).removeprefix("torch."),
             "quantization": mc.quantization, "code_revision": mc.code_revision,
             "model_weights": mc.model_weights or None}
    fp = model_fingerprint(mc.model, revision=mc.revision, config=mc.hf_config.to_dict(), extra=extra)
    return f"weights:{fp.digest}"


def build_namespace(vllm_config: "VllmConfig", block_tokens: int, model_id: Optional[str] = None,
                    kv_layout: Optional[str] = None) -> Namespace:
    """The namespace of this engine's blocks: everything that changes the
    bytes of a page (the model's identity, KV dtype, shape, page size,
    platform and, off CPU, vLLM's physical KV layout: CUDA backends order a
    page's bytes in several ways; the CPU backend has one, LBHNC, and its
    name is kept as it was so existing CPU blocks stay valid). The model's
    identity is `model_id` when given (kv_connector_extra_config's
    `ucm_model_id`), else `model_identity(vllm_config.model_config)`."""
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(cc.cache_dtype)
    if dtype == "auto":
        dtype = str(mc.dtype).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        raise ConfigError(f"vLLM KV cache dtype {dtype!r} is not supported by ucm; allowed: {sorted(KV_DTYPES)}")
    return Namespace(
        model=model_id or model_identity(mc),
        kv_dtype=KV_DTYPES[dtype],
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        block_tokens=block_tokens,
        tp_rank=0,
        tp_size=pc.tensor_parallel_size,
        layout=f"vllm-{current_platform.device_type}-page{cc.block_size}" + (
            f"-{kv_layout}" if kv_layout and current_platform.device_type != "cpu" else ""),
    )

