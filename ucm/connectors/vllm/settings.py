"""What UCMConnector reads from vLLM's `kv_connector_extra_config` (the
`ucm_*` keys), and the checks of vLLM's setup that both sides rely on.
Runs once per connector instance, at construction; raises ConfigError
naming the bad value and the allowed ones."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from ucm.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

LOAD_MODES = ("auto", "sync", "async")
PREFETCH_POLICIES = ("off", "best_effort", "wait_complete", "timeout")
STREAMING = ("off", "auto", "on")
# The settings a request may override through its `kv_transfer_params`
# (vLLM: SamplingParams.extra_args["kv_transfer_params"], or the OpenAI
# server's "kv_transfer_params" field), under the same `ucm_` names. The
# others name the engine's cache, namespace or worker waits and stay per engine.
PER_REQUEST = ("load_mode", "load_streaming", "prefetch_policy", "prefetch_timeout_s",
               "prefetch_timeout_per_1k_tokens_s", "pd_wait_s")
# What a request's `kv_transfer_params` carry under `ucm_` names that is not a
# setting: the blocks a prefill engine names (pd.py), the spans of the
# chunks to blend and the request's blend options (blend_request.py).
REQUEST_DATA = ("blocks", "chunks", "blend")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from kv_connector_extra_config."""

    ucm_config: Union[None, str, Mapping[str, Any]] = None  # YAML path or mapping; None: $UCM_CONFIG/defaults
    model_id: Optional[str] = None  # names the model in block keys (default: a fingerprint of the weights)
    load_mode: str = "auto"  # auto: sync from DRAM, async below; or force "sync" / "async"
    load_timeout_s: float = 30.0  # an asynchronous load waits at most this long for saves in flight
    # Bytes of landing-tier blocks that requests still waiting for vLLM's
    # pages may keep pinned (pins below it, and of a request's own staged
    # blocks, are not counted); hits beyond it are misses. None: a quarter
    # of the landing tier.
    max_waiting_pin_bytes: Optional[int] = None
    # A hit below the landing tier: "off" loads it asynchronously (the
    # request holds its pages while the worker stages); otherwise the
    # scheduler stages it first (`CacheAPI.prefetch`) while the request
    # waits without pages, and then loads from the landing tier:
    # "best_effort" answers at once with what is there (the rest is
    # computed; the staging serves later requests), "wait_complete" waits
    # for the staging (at most load_timeout_s), "timeout" at most
    # prefetch_timeout_s + prefetch_timeout_per_1k_tokens_s per 1,000 hit tokens.
    prefetch_policy: str = "off"
    # Layer-wise streaming of loads (load_mode "auto" only): "auto" streams
    # hits below the landing tier under the forward (each layer waited for
    # in wait_for_layer_load) instead of loading them asynchronously; "on"
    # streams landing-tier hits too; "off" (default: what `ucm bench vllm`
    # measured faster for NVMe-only hits on vLLM for CPU) never streams.
    load_streaming: str = "off"
    prefetch_timeout_s: float = 0.5
    prefetch_timeout_per_1k_tokens_s: float = 0.05
    # P/D (pd.py): how long a decode engine's worker waits for the blocks a
    # prefill engine named to be committed before vLLM computes the rest.
    pd_wait_s: float = 10.0
    # Blend (blend_request.py): a string whose tokens separate a prompt's
    # parts, as LMCache's CacheBlend takes them: system prompt, separator,
    # passage, separator, ..., passage, separator, question. A request
    # without `ucm_chunks` whose prompt holds it twice or more is blended
    # with the parts between separators as its passages. None: spans only.
    blend_separator: Optional[str] = None

    def __post_init__(self) -> None:
        _check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "kv_connector_extra_config")

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "ConnectorSettings":
        """The settings in `extra`; keys without the `ucm_` prefix belong to
        others and are ignored, unknown `ucm_` keys are refused."""
        prefix = "ucm_"
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in (extra or {}).items():
            if not k.startswith(prefix):
                continue
            name = k[len(prefix):] if k != "ucm_config" else "ucm_config"
            if name not in known:
                raise ConfigError(f"kv_connector_extra_config: unknown key {k!r}; allowed: "
                                  f"{sorted(prefix + n if n != 'ucm_config' else n for n in known)}")
            kwargs[name] = v
        return cls(**kwargs)

    def for_request(self, params: Optional[Mapping[str, Any]]) -> "ConnectorSettings":
        """These settings with a request's overrides: the `ucm_` keys of its
        `kv_transfer_params` among PER_REQUEST (REQUEST_DATA are read
        elsewhere, other keys belong to other connectors). A bad value or a `ucm_` key that is not per request
        raises ConfigError naming `kv_transfer_params.<key>`."""
        if not params or not isinstance(params, Mapping):
            return self
        kwargs = {}
        for k, v in params.items():
            if not isinstance(k, str) or not k.startswith("ucm_") or k[4:] in REQUEST_DATA:
                continue
            if k[4:] not in PER_REQUEST:
                raise ConfigError(f"kv_transfer_params: {k!r} cannot be set per request; allowed: "
                                  f"{['ucm_' + n for n in PER_REQUEST]}")
            kwargs[k[4:]] = v
        if not kwargs:
            return self
        _check(kwargs, "kv_transfer_params")
        return dataclasses.replace(self, **kwargs)


def _check(values: Mapping[str, Any], where: str) -> None:
    """Raises ConfigError naming `where`.ucm_<key>, the value and the
    allowed ones for the first bad value among `values` (field name -> value)."""
    for name, allowed in (("load_mode", LOAD_MODES), ("prefetch_policy", PREFETCH_POLICIES),
                          ("load_streaming", STREAMING)):
        if name in values and values[name] not in allowed:
            raise ConfigError(f"{where}.ucm_{name}: {values[name]!r} not one of {list(allowed)}")
    for name in ("load_timeout_s", "prefetch_timeout_s", "prefetch_timeout_per_1k_tokens_s", "pd_wait_s"):
        if name not in values:
            continue
        t = values[name]
        number = isinstance(t, (int, float)) and not isinstance(t, bool)
        if not (number and (t > 0 if name == "load_timeout_s" else t >= 0)):
            bound = "> 0" if name == "load_timeout_s" else ">= 0"
            raise ConfigError(f"{where}.ucm_{name} must be a number {bound}, got {t!r}")
    sep = values.get("blend_separator")
    if sep is not None and not (isinstance(sep, str) and sep.strip()):
        raise ConfigError(f"{where}.ucm_blend_separator must be a non-blank string or absent, got {sep!r}")
    cap = values.get("max_waiting_pin_bytes")
    if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap > 0):
        raise ConfigError(f"{where}.ucm_max_waiting_pin_bytes must be a positive int (bytes) or absent, "
                          f"got {cap!r}")


def check_engine(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", block_tokens: int) -> int:
    """Refuses a vLLM setup this connector does not support (tensor or
    pipeline parallelism, several KV cache groups, a ucm block that is not
    whole vLLM pages); returns the vLLM pages per ucm block."""
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ConfigError(f"UCMConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 for now, "
                          f"got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}")
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ConfigError(f"UCMConnector supports one KV cache group, got {len(kv_cache_config.kv_cache_groups)}")
    return pages_per_block(block_tokens, vllm_config.cache_config.block_size)


def pages_per_block(block_tokens: int, page_tokens: int) -> int:
    """vLLM pages (of `page_tokens`, its --block-size) in one ucm block."""
    if block_tokens % page_tokens:
        raise ConfigError(
            f"block_tokens: {block_tokens} is not a multiple of vLLM's page size (--block-size) "
            f"{page_tokens}; use a multiple of {page_tokens}, e.g. {page_tokens} or {2 * page_tokens}")
    return block_tokens // page_tokens
