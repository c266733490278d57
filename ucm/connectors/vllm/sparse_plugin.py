"""The `vllm.general_plugins` entry point of sparse decode (`ucm_sparse`).

vLLM calls `register()` once in each of its processes (the front end,
EngineCore, every worker; `vllm.plugins.load_general_plugins`, allowlisted
by `VLLM_PLUGINS` when that is set), before any config exists: the switch
is therefore the environment variable `UCM_VLLM_SPARSE` (sparse_config.py),
not the YAML. With it off (unset) it does nothing: vLLM keeps its stock
backend, byte for byte, whatever the ucm config lists. With it on it
validates the variable's options (a bad value is a ConfigError that stops
the engine, never a silent dense run) and, on vLLM for CPU, points
`CPU_ATTN`'s class path at ucm's backend (sparse_backend.py) with
`register_backend`; vLLM for CPU always takes `CPU_ATTN`, whatever
`--attention-backend` says. The backend then builds the `sparse`
accelerator from the ucm config's entry and the variable's options.

CUDA is not covered: the backend there would be vLLM's `CUSTOM` slot
(`register_backend(AttentionBackendEnum.CUSTOM, ...)` plus
`--attention-backend CUSTOM`) wrapping FlashAttention's paged layout, and
none is written or tested yet, so on any platform other than CPU
`register()` refuses a sparse request with a ConfigError rather than run
dense. Idempotent: registering twice points the same path again.
"""
from __future__ import annotations

import logging

from ucm.connectors.vllm.sparse_config import ENV_SPARSE, sparse_from_env
from ucm.errors import ConfigError

log = logging.getLogger(__name__)

ENTRY_POINT = "ucm_sparse"


def register() -> None:
    """Points `CPU_ATTN` at ucm's sparse backend when `UCM_VLLM_SPARSE` asks for it (module docstring)."""
    cfg = sparse_from_env()
    if cfg is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ConfigError(f"{ENV_SPARSE}: sparse decode in vLLM is implemented for vLLM's CPU backend (CPU_ATTN) "
                          f"only, this platform is {current_platform.device_name!r}; unset {ENV_SPARSE}")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ucm.connectors.vllm.sparse_backend import BACKEND_PATH

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    log.info("ucm sparse decode: CPU_ATTN -> %s (%s sets %s; the other options come from the ucm config's "
             "`sparse` entry, else the defaults)", BACKEND_PATH, ENV_SPARSE, sorted(cfg.model_fields_set) or "none")
