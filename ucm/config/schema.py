"""Configuration: one YAML file, a typed and frozen schema.

Unknown keys and bad values raise `ConfigError` naming the key and what is
allowed. Sizes are written like `4GiB`. Environment variables override
single keys: `UCM_<KEY>` with `__` between levels and tiers addressed by
adapter name or index, e.g. `UCM_BLOCK_TOKENS=128`,
`UCM_TIERS__NVME__CAPACITY=8GiB`, `UCM_POLICY__NAME=lru`; values are read as
YAML scalars. `UCM_CONFIG` names the file used when none is given;
`UCM_MODEL_CACHE`, `UCM_PROGRESS` and `UCM_VLLM_SPARSE` belong to other
parts of ucm (the model directories, the progress bars, sparse decode in
vLLM: ucm/connectors/vllm/sparse_config.py) and are not read as keys.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ucm.errors import ConfigError
from ucm.config.sizes import parse_size, positive_size
from ucm.config.validation import describe_validation_error

ENV_PREFIX = "UCM_"
ENV_CONFIG = "UCM_CONFIG"
# UCM_ variables that are not config keys (ucm.apps.model, ucm.progress,
# ucm.connectors.vllm.sparse_config)
ENV_NOT_KEYS = frozenset({ENV_CONFIG, "UCM_MODEL_CACHE", "UCM_PROGRESS", "UCM_VLLM_SPARSE"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Strict):
    adapter: str  # an installed `ucm.adapters` entry point: hbm, dram, nvme, ...
    capacity: int  # bytes; written like 4GiB
    options: dict[str, Any] = Field(default_factory=dict)  # the adapter's own Config
    # Fraction of the capacity kept free by demoting the policy's victims in
    # the background (write-on-evict, ahead of need), so that stores and
    # staged hits find free room without waiting for the tier below.
    headroom: float = Field(default=0.0, ge=0.0, lt=1.0)
    # How blocks are stored in this tier (ucm.codecs): none (as the engine
    # wrote them), lossless, int8, int4, or an installed `ucm.codecs` entry
    # point. Only tiers below the landing tier take one.
    codec: str = "none"
    # A cluster tier (one other nodes read: mooncake, redis) that receives
    # a copy of every block stored on this node at once, in the background,
    # instead of on its demotion: a decode node of P/D finds a prefill
    # node's blocks as soon as they are stored (ucm/cache/write_through.py).
    write_through: bool = False

    @field_validator("headroom", mode="before")
    @classmethod
    def _headroom(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().endswith("%"):
            try:
                return float(v.strip()[:-1]) / 100.0
            except ValueError:
                raise ValueError(f"must be a fraction in [0, 1) or a percentage like 5%, got {v!r}") from None
        return v

    @field_validator("capacity", mode="before")
    @classmethod
    def _capacity(cls, v: Any) -> int:
        return positive_size(v)


class PolicyConfig(_Strict):
    name: str = "heat"  # an installed `ucm.policies` entry point
    options: dict[str, Any] = Field(default_factory=dict)


class HeatConfig(_Strict):
    half_life_requests: float = Field(default=2000.0, gt=0)  # heat halves every N requests
    # Memory for the HeatTracker's per-block history (records outlive
    # residency so a block that comes back is known as reused): about
    # ucm.placement.heat.RECORD_BYTES per block; written like 256MiB; at least 1MiB.
    history_bytes: int = 256 << 20

    @field_validator("history_bytes", mode="before")
    @classmethod
    def _history(cls, v: Any) -> int:
        n = parse_size(v)
        if n < 1 << 20:
            raise ValueError(f"history_bytes must be at least 1MiB (1048576), got {v!r}")
        return n


class AcceleratorConfig(_Strict):
    name: str  # an installed `ucm.accelerators` entry point
    options: dict[str, Any] = Field(default_factory=dict)


class ServiceConfig(_Strict):
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # names the socket
    socket: Optional[str] = None  # Unix socket path; default <runtime dir>/<name>.sock
    metrics_host: str = "127.0.0.1"
    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535)  # None: no metrics endpoint; 0: any free port
    max_frame_bytes: int = Field(default=4 << 20, ge=4096, le=64 << 20)
    max_keys: int = Field(default=65536, ge=1, le=1 << 20)  # keys per request
    request_timeout_s: float = Field(default=30.0, gt=0)  # client side, per request
    # Both ends poll this long for the next frame before sleeping: a sleeping
    # CPU (an idle VM's vCPU above all) takes tens of microseconds to wake.
    poll_spin_us: int = Field(default=100, ge=0, le=10_000)
    # Slots of the shared key index clients answer lookups from (16 bytes
    # each; it holds up to 3/4 as many blocks); 0 turns it off.
    index_slots: int = Field(default=1 << 20, ge=0, le=1 << 30)

    @field_validator("index_slots")
    @classmethod
    def _slots(cls, v: int) -> int:
        if v and (v < 8 or v & (v - 1)):
            raise ValueError(f"must be 0 or a power of two >= 8, got {v}")
        return v

    @field_validator("max_frame_bytes", mode="before")
    @classmethod
    def _frame(cls, v: Any) -> int:
        return parse_size(v)


class EventsConfig(_Strict):
    # The block catalog behind the KV events routers read (ucm.cache.catalog).
    enabled: bool = True
    max_blocks: int = Field(default=1 << 16, ge=1, le=1 << 24)  # block descriptions kept (token ids: 4 bytes each)
    journal: int = Field(default=1 << 16, ge=16, le=1 << 24)  # changes kept for readers that fall behind
    # A file keeping the descriptions across restarts, so that blocks a persistent
    # tier (NVMe, a cluster store) kept are advertised again; none: in memory only.
    path: Optional[str] = Field(default=None, min_length=1)


class UcmConfig(_Strict):
    block_tokens: int = Field(default=256, gt=0)  # tokens per block; a multiple of the engine's page size
    tiers: tuple[TierConfig, ...] = (
        TierConfig(adapter="dram", capacity=1 << 30),
    )
    landing_tier: str = "dram"  # the adapter new blocks are stored into
    policy: PolicyConfig = PolicyConfig()
    heat: HeatConfig = HeatConfig()
    io_workers: int = Field(default=4, ge=1, le=64)  # threads running asynchronous loads and stores
    service: ServiceConfig = ServiceConfig()
    accelerators: tuple[AcceleratorConfig, ...] = ()  # in the order their hooks run
    events: EventsConfig = EventsConfig()

    @model_validator(mode="after")
    def _check(self) -> "UcmConfig":
        from ucm.adapters.base import adapter_names

        names = [t.adapter for t in self.tiers]
        if not names:
            raise ValueError("tiers: at least one tier is required")
        known = adapter_names()
        for i, n in enumerate(names):
            if n not in known:
                raise ValueError(f"tiers.{i}.adapter: unknown adapter {n!r}; installed: {known}")
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: each adapter may appear once, got {names}")
        from ucm.codecs import codec_names

        allowed = codec_names()
        for i, t in enumerate(self.tiers):
            if t.codec not in allowed:
                raise ValueError(f"tiers.{i}.codec: unknown codec {t.codec!r}; allowed: {allowed}")
            if t.codec != "none" and t.adapter == self.landing_tier:
                raise ValueError(f"tiers.{i}.codec: the landing tier ({t.adapter}) keeps blocks as the engine "
                                 f"wrote them; a codec applies to the tiers below it, got {t.codec!r}")
        accs = [a.name for a in self.accelerators]
        if len(set(accs)) != len(accs):
            raise ValueError(f"accelerators: each accelerator may appear once, got {accs}")
        if self.landing_tier not in names:
            raise ValueError(f"landing_tier: {self.landing_tier!r} is not one of the configured tiers {names}")
        for i, t in enumerate(self.tiers):
            if t.write_through and names.index(t.adapter) <= names.index(self.landing_tier):
                raise ValueError(f"tiers.{i}.write_through: only a tier below the landing tier "
                                 f"({self.landing_tier}) takes copies of what is stored there, got {t.adapter}")
        if self.tiers[-1].headroom:
            raise ValueError(f"tiers.{len(names) - 1}.headroom: only a tier with a tier below it can keep "
                             f"headroom (its victims are demoted there); the lowest tier must have 0, "
                             f"got {self.tiers[-1].headroom}")
        return self


def _env_overrides(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(raw)) or {}  # deep copy of plain data
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in ENV_NOT_KEYS:
            continue
        path = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        try:
            value = yaml.safe_load(environ[var]) if environ[var] != "" else ""
        except (yaml.YAMLError, RecursionError, ValueError) as exc:  # ValueError: an impossible date
            raise ConfigError(f"{var}: the value is not valid YAML: {exc}") from None
        node: Any = data
        model: Any = UcmConfig
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(node, list):
                idx = next((i for i, t in enumerate(node) if isinstance(t, dict) and t.get("adapter") == part), None)
                if idx is None and part.isdigit() and int(part) < len(node):
                    idx = int(part)
                if idx is None:
                    tiers = [t.get("adapter") for t in node if isinstance(t, dict)]
                    raise ConfigError(f"{var}: no tier {part!r}; configured tiers: {tiers}")
                if last:
                    raise ConfigError(f"{var}: names a whole tier; name one of its keys")
                node = node[idx]
                model = TierConfig
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: {'.'.join(path[:depth])} is not a mapping")
            fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else None
            if fields is not None and part not in fields:
                raise ConfigError(f"{var}: unknown key {part!r}; allowed: {sorted(fields)}")
            if last:
                node[part] = value
            else:
                if part not in node or node[part] is None:
                    if part == "tiers":
                        raise ConfigError(f"{var}: no tiers configured to override")
                    node[part] = {}
                node = node[part]
                ann = fields[part].annotation if fields is not None else None
                if isinstance(ann, type) and issubclass(ann, BaseModel):
                    model = ann
                else:
                    model = None  # free mapping (options) or a tuple of tiers
    return data


def load_config(source: Union[None, str, os.PathLike, Mapping[str, Any]] = None,
                environ: Optional[Mapping[str, str]] = None, replay: bool = False) -> UcmConfig:
    """Reads, overrides from the environment, and validates a configuration.

    `source`: a YAML path, an already-parsed mapping, or None for the file
    named by UCM_CONFIG (or the built-in defaults). `replay`: for a trace
    replay, which may use a policy that needs the trace's future (`opt`).
    """
    env = os.environ if environ is None else environ
    if source is None and env.get(ENV_CONFIG):
        source = env[ENV_CONFIG]
    if source is None:
        raw: Any = {}
    elif isinstance(source, Mapping):
        raw = dict(source)
    else:
        path = Path(source)
        try:
            text = path.read_text()
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, or text that is not UTF-8
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from exc
        try:
            raw = yaml.safe_load(text) or {}
        except (yaml.YAMLError, RecursionError, ValueError) as exc:  # nesting past the parser; an impossible date
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(raw).__name__}")
    raw = _env_overrides(raw, env)
    try:
        cfg = UcmConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, UcmConfig)) from None
    for i, tier in enumerate(cfg.tiers):
        adapter_options(tier, index=i)
    _check_policy(cfg.policy, replay)
    check_accelerators(cfg)
    return cfg


def check_accelerators(cfg: UcmConfig) -> None:
    """Every configured accelerator installed and its options valid
    (ConfigError naming `accelerators.<i>...` otherwise)."""
    from ucm.accelerators.base import check_accelerator

    for i, acc in enumerate(cfg.accelerators):
        check_accelerator(acc.name, acc.options, i)


def adapter_options(tier: TierConfig, index: int = 0) -> BaseModel:
    """The tier's options validated against its adapter's Config."""
    from ucm.adapters.base import load_adapter_class

    cls = load_adapter_class(tier.adapter)
    try:
        return cls.Config.model_validate(tier.options)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, cls.Config, prefix=f"tiers.{index}.options.")) from None


def _check_policy(policy: PolicyConfig, replay: bool = False) -> None:
    """An installed policy (a live one unless `replay`), its options valid
    (ConfigError otherwise)."""
    from ucm.placement.policies.base import check_policy

    check_policy(policy.name, policy.options, replay=replay)
