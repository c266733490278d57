"""The accelerator interface: the hook points an accelerator receives, and
how accelerators are found and configured.

An accelerator is a module on top of the cache API. It is registered in the
`ucm.accelerators` entry points (one line in a package's metadata, as
adapters and policies are), enabled in the YAML file

    accelerators:
      - name: prefetch
        options: {max_inflight_blocks: 512}

and built once per process that calls its hooks, with the `CacheAPI` of
that process and the configuration it runs under (`Accelerator(cache,
config, **options)`; `config` is read through `CacheSettings`: tier order
and capacities, landing tier, block size, the accelerators listed). It uses only
the public API plus the hooks; it never reaches into the cache's internals.

Hook points, each with one event value (new fields may be added to an
event; an accelerator reads the ones it knows):
- `request_seen(RequestSeen)`: a request's prompt was seen for the first
  time (`CacheAPI.begin_request`: the scheduler's lookup);
- `blocks_stored(BlocksStored)`: blocks became cached (a store or a
  committed slot write);
- `blocks_loaded(BlocksLoaded)`: blocks were read for a request (a load or
  a slot read), with each block's outcome and the tier that served it;
- `request_finished(RequestFinished)`: the request ended
  (`CacheAPI.finish`).
Each is called after the cache did its work, outside its locks, on the
thread that did it (an engine's call or an I/O worker): a hook must be
short and must not block; long work goes to the accelerator's own thread or
to the asynchronous API (`prefetch`, `load`), whose handles it may keep.
Nothing an accelerator does changes the result of the call that fired the
hook: an exception from a hook is counted (`errors`) and logged, never
raised into the caller (`ucm.accelerators.chain.Accelerators`).

`counters()` answers the accelerator's figures (numbers by name), shown by
`ucm inspect` and `stats()["accelerators"]`; `close()` ends its work.

Where it runs (`runs_in`, data on the class):
- "cache" (the default): built by the cache (UnifiedCache, in the engine's
  process or in the service) with the rest of its chain, and fed the hooks
  above there (prefetch);
- "engine": built in each engine process by its connector
  (`Accelerators.build(config, cache, runs_in="engine")`), for work only
  the engine's forward pass can do (sparse attention selects per layer and
  decode step). Such an accelerator declares its own typed interface; the
  connector reaches it with `Accelerators.get(SparseAccelerator)` and calls
  it directly, and calls the hooks above that apply. `EngineAccelerator`
  is the base of such ones: it keeps the figures their connector
  `record`s (sparse, blend).

Options: an accelerator declares them as its `Config` (a frozen pydantic
model that forbids unknown keys), validated when the configuration loads;
a bad option is a ConfigError naming `accelerators.<i>.options.<key>`.
"""
from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

from ucm.config.validation import describe_validation_error
from ucm.errors import ConfigError

if TYPE_CHECKING:
    from ucm.api import CacheAPI, Key, Outcome

ACCELERATOR_NAMESPACE = "ucm.accelerators"
RUNS_IN = ("cache", "engine")  # where an accelerator is built and called (module docstring)


class TierSettings(Protocol):
    """One configured tier, as an accelerator reads it."""

    @property
    def adapter(self) -> str: ...

    @property
    def capacity(self) -> int:
        """Bytes."""


class AcceleratorEntry(Protocol):
    """One entry of the configured `accelerators` list."""

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> Mapping[str, Any]: ...


class CacheSettings(Protocol):
    """What accelerators read of the configuration their cache runs under
    (`ucm.config.UcmConfig` is one; declared here so that this interface
    does not import the config schema, which imports it to check names)."""

    @property
    def block_tokens(self) -> int: ...

    @property
    def tiers(self) -> Sequence[TierSettings]:
        """Fastest first."""

    @property
    def landing_tier(self) -> str:
        """The adapter name of the tier new blocks land in."""

    @property
    def accelerators(self) -> Sequence[AcceleratorEntry]:
        """In the order their hooks run."""


class AcceleratorOptions(BaseModel):
    """An accelerator's options (`accelerators[i].options`): none by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class RequestSeen:
    request_id: str
    keys: tuple["Key", ...]  # the prompt's full blocks, in order
    parent: Optional["Key"]  # the block before keys[0], if any
    # Per key, as this cache's placement knew it when the request was seen
    # (blocks other nodes put into a shared tier are not known here): the
    # fastest tier holding it (None: not cached) and the bytes placement
    # accounts for it (its footprint in a tier: a slot may round the payload
    # up; 0: not cached).
    tiers: tuple[Optional[str], ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    keys: tuple["Key", ...]  # the blocks this call made cached (not those it found cached)
    sizes: tuple[int, ...]  # their payload bytes
    tier: str  # where they landed
    request_id: Optional[str]


@dataclass(frozen=True, slots=True)
class BlocksLoaded:
    keys: tuple["Key", ...]
    outcomes: tuple["Outcome", ...]  # per key, as the load answered
    tiers: tuple[Optional[str], ...]  # per key, the tier that served it (None: not served)
    request_id: Optional[str]


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: Optional[str]
    keys: tuple["Key", ...]
    output_tokens: int


class Accelerator(abc.ABC):
    """One accelerator instance in one process; every hook defaults to nothing."""

    name: str = ""
    Config: type[AcceleratorOptions] = AcceleratorOptions
    runs_in: ClassVar[str] = "cache"  # one of RUNS_IN

    def __init__(self, cache: "CacheAPI", config: CacheSettings, **options: Any) -> None:
        self.options = validate_options(type(self), options)
        self.cache = cache
        self.config = config

    def request_seen(self, event: RequestSeen) -> None:
        """A request's prompt was seen for the first time."""

    def blocks_stored(self, event: BlocksStored) -> None:
        """Blocks became cached."""

    def blocks_loaded(self, event: BlocksLoaded) -> None:
        """Blocks were read for a request."""

    def request_finished(self, event: RequestFinished) -> None:
        """A request ended."""

    def counters(self) -> dict[str, float]:
        """The accelerator's figures by name (a snapshot)."""
        return {}

    def close(self) -> None:
        """Ends the accelerator's work (called once, when its cache closes)."""


class EngineAccelerator(Accelerator):
    """An accelerator that runs in the engine's process and whose figures
    its connector reports: `record` adds numbers by name, from any thread;
    `counters` answers their sums."""

    runs_in = "engine"

    def __init__(self, cache: "CacheAPI", config: CacheSettings, **options: Any) -> None:
        super().__init__(cache, config, **options)
        self._counts_lock = threading.Lock()
        self._counts: dict[str, float] = {}

    def record(self, counts: Mapping[str, float]) -> None:
        with self._counts_lock:
            for name, n in counts.items():
                self._counts[name] = self._counts.get(name, 0) + n

    def counters(self) -> dict[str, float]:
        with self._counts_lock:
            return dict(self._counts)


def validate_options(cls: type[Accelerator], options: dict[str, Any], prefix: str = "options.") -> AcceleratorOptions:
    """`options` checked against the accelerator's Config, else ConfigError."""
    try:
        return cls.Config.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(f"accelerator {cls.name!r}: "
                          + describe_validation_error(exc, cls.Config, prefix=prefix)) from None


def accelerator_names() -> list[str]:
    """The names registered in the `ucm.accelerators` entry points."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ACCELERATOR_NAMESPACE)})


def load_accelerator_class(name: str, where: str = "name") -> type[Accelerator]:
    """The class registered as `name`; ConfigError naming `where` for an
    unknown name, and naming the entry point for one that fails to load or
    does not name an Accelerator."""
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group=ACCELERATOR_NAMESPACE)}
    if name not in eps:
        raise ConfigError(f"{where}: unknown accelerator {name!r}; installed: {sorted(eps)}")
    ep = eps[name]
    try:
        cls = ep.load()
    except Exception as exc:
        raise ConfigError(f"{where}: accelerator entry point {name} = {ep.value!r} failed to load: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise ConfigError(f"{where}: accelerator entry point {name} = {ep.value!r} is not a "
                          f"ucm.accelerators.base.Accelerator subclass")
    if cls.runs_in not in RUNS_IN:
        raise ConfigError(f"{where}: accelerator entry point {name} = {ep.value!r} declares runs_in "
                          f"{cls.runs_in!r}, not one of {list(RUNS_IN)}")
    return cls


def check_accelerator(name: str, options: dict[str, Any], index: int) -> type[Accelerator]:
    """The class of accelerator `name`, its options validated (ConfigError
    naming `accelerators.<index>...` otherwise)."""
    cls = load_accelerator_class(name, where=f"accelerators.{index}.name")
    validate_options(cls, options, prefix=f"accelerators.{index}.options.")
    return cls
