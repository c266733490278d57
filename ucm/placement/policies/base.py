"""The placement-policy interface and its value types.

A policy instance orders the blocks resident in one tier and decides what
enters it. The cache (or the trace replay) builds one instance per tier and
calls it under its own lock: methods must be fast and must not block.

Calls a policy receives, per tier:
- `on_insert(key, size_bytes)` — the block became resident in this tier (no
  access is counted by the insert itself).
- `on_hit(key)` — one access served by this tier (also after an insert, once
  per request occurrence). Within a request the cache reports accesses
  deepest block first, so a parent is always at least as recent as its child.
- `on_remove(key)` — the block left this tier (evicted, moved, deleted).
- `on_reclass(key)` — the HeatTracker learned more about the block without
  an access (its request reported its output length); a policy that files
  blocks by what the tracker knows re-files it. Default: nothing.
- `on_copied_up(key)` — a promotion read the block out of this tier into the
  landing tier (a load's hit here, or a staging); this copy stays, and the
  access is reported to the landing tier. Default: nothing; lru counts it as
  a use of this copy (else a block reused through DRAM keeps, below, the
  recency of its first demotion and is the lowest tier's victim).
- `victim(evictable)` — the block to evict next among those for which
  `evictable(key)` is true (the cache excludes pinned blocks and parents whose
  children are resident), or None if there is none.
- `admit(key, why)` — whether the block may enter this tier now: a new block,
  a demotion from the tier above, or a promotion from a tier below.

Policies read shared statistics (frequency, recency, prefix links, and in
trace replay the oracle's next use) from the HeatTracker they are given:
by key (`heat.parent(key)`, `heat.next_use(key)`, `heat.get(key)` for a
snapshot) or, on the hot path, by record slot (`s = heat.slot(key)`, then
`heat.last[s]`, `heat.count[s]`, `heat.flags[s]`); they never write it. A
policy that learns from every access, misses included, subscribes a
listener to the tracker (`heat.subscribe`, see ucm/placement/heat.py: access, tick,
forget and reclass events), as the heat policy's ReuseModel does
(ucm/placement/policies/reuse.py).

Cost. Every call runs under the cache's one metadata lock, several times
per stored block (an insert into a full tier is a `victim` there, an
`admit` and `on_insert` below, a `victim` below, two `on_remove`s); keep
each O(1) or O(log n) amortised. The `evictable` predicate passed to
`victim` is built once per tier and reads the cache's state when called:
call it only for the keys you are about to offer, and do not keep what it
answered across calls.

Options. A policy declares the options it takes as its `Config` (a frozen
pydantic model that forbids unknown keys; none by default), validated when
the configuration is loaded (`check_policy`) and again at construction;
a bad option is a ConfigError naming `policy.options.<key>`. A policy that
needs what only a trace replay knows (the oracle's next use) sets
`live = False`: a live cache refuses it.

Native implementations. A policy class may declare `native = "<name>"`, the
name of its twin in the C++ placement core (`ucm._native.placement_policies()`;
the table in cpp/src/policies.cpp, the interface in cpp/include/ucm/policy_core.hpp),
which makes exactly its decisions. Every shipped policy has one. `Placement` then
keeps the whole per-block bookkeeping, tier stack and policy queues in C++
(ucm/placement/native.py) and creates no instance of the Python class. The
declaration holds for the class that makes it only, not for subclasses (a
subclass that changes a method would otherwise be replaced by its parent's
twin), and only when the policy is loaded through `load_policy` (a
`BoundPolicy`) with no options. Every other policy, third-party ones from
the `ucm.policies` entry points included, runs on the Python path. A
native twin must pass tests/unit/test_placement_native.py, which replays
generated traces through both paths and compares every plan.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from ucm.config.validation import describe_validation_error
from ucm.errors import ConfigError, PolicyNotFoundError
from ucm.placement.heat import HeatTracker, Key

POLICY_NAMESPACE = "ucm.policies"


class Admission(enum.Enum):
    NEW = "new"  # freshly computed block stored into its landing tier
    DEMOTE = "demote"  # evicted from the tier above, written here
    PROMOTE = "promote"  # hit in a tier below, copied up here


@dataclass(frozen=True, slots=True)
class TierInfo:
    name: str
    index: int  # 0 = fastest
    capacity_bytes: int
    lowest: bool  # no tier below this one


class PolicyOptions(BaseModel):
    """A policy's options (`policy.options` in the config): none by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PlacementPolicy(abc.ABC):
    """Eviction order and admission for the blocks of one tier."""

    name: str = ""
    Config: type[PolicyOptions] = PolicyOptions
    live: bool = True  # False: needs the trace's future, replay only
    native: Optional[str] = None  # its twin in the C++ placement core (see the module docstring)

    def __init__(self, tier: TierInfo, heat: HeatTracker, **options: Any) -> None:
        self.options = validate_options(type(self), options)
        self.tier = tier
        self.heat = heat

    @abc.abstractmethod
    def on_insert(self, key: Key, size_bytes: int) -> None: ...

    @abc.abstractmethod
    def on_hit(self, key: Key) -> None: ...

    @abc.abstractmethod
    def on_remove(self, key: Key) -> None: ...

    @abc.abstractmethod
    def victim(self, evictable: Callable[[Key], bool]) -> Optional[Key]: ...

    def on_reclass(self, key: Key) -> None:
        """The tracker's record of `key` changed without an access."""

    def on_copied_up(self, key: Key) -> None:
        """A promotion read `key` out of this tier (see the module docstring)."""

    def admit(self, key: Key, why: Admission) -> bool:
        return True


PolicyFactory = Callable[[TierInfo, HeatTracker], PlacementPolicy]


@dataclass(frozen=True, eq=False)
class BoundPolicy:
    """A policy class with its validated options: the factory `load_policy`
    returns (call it with a tier and a tracker for one instance)."""

    name: str  # its entry-point name
    cls: type[PlacementPolicy]
    options: dict[str, Any]

    def __call__(self, tier: TierInfo, heat: HeatTracker) -> PlacementPolicy:
        return self.cls(tier, heat, **self.options)

    @property
    def policy_name(self) -> str:
        return self.name

    @property
    def native(self) -> Optional[str]:
        """The name of the native twin to use instead of the class, or None
        (see the module docstring)."""
        if self.options:
            return None
        return self.cls.__dict__.get("native")


def validate_options(cls: type[PlacementPolicy], options: dict[str, Any]) -> PolicyOptions:
    """`options` checked against the policy's Config, else ConfigError."""
    try:
        return cls.Config.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(f"policy {cls.name!r}: "
                          + describe_validation_error(exc, cls.Config, prefix="policy.options.")) from None


def policy_names() -> list[str]:
    """The names registered in the `ucm.policies` entry points."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=POLICY_NAMESPACE)})


def load_policy_class(name: str) -> type[PlacementPolicy]:
    """The policy class registered as `name` in the `ucm.policies` entry points."""
    from stevedore import ExtensionManager

    mgr = ExtensionManager(namespace=POLICY_NAMESPACE, invoke_on_load=False,
                           on_load_failure_callback=_raise_load_failure)
    names = sorted(mgr.names())
    if name not in names:
        raise PolicyNotFoundError(
            f"No {POLICY_NAMESPACE!r} driver found, looking for {name!r}; available: {names}"
        )
    return mgr[name].plugin


def check_policy(name: str, options: dict[str, Any], replay: bool = False) -> type[PlacementPolicy]:
    """The class of policy `name`, its options validated; ConfigError for an
    unknown policy, a bad option, or (unless `replay`) a replay-only policy."""
    names = policy_names()
    if name not in names:
        raise ConfigError(f"policy.name: unknown policy {name!r}; installed: {names}")
    cls = load_policy_class(name)
    if not cls.live and not replay:
        live = [n for n in names if load_policy_class(n).live]
        raise ConfigError(f"policy.name: {name!r} is for trace replay only (it needs each block's next use, "
                          f"which a live cache cannot know); live policies: {live}")
    validate_options(cls, options)
    return cls


def load_policy(name: str, **options: Any) -> BoundPolicy:
    """Finds the policy class registered as `name` in the `ucm.policies`
    entry points and returns a factory binding `options` (validated now)."""
    cls = load_policy_class(name)
    validate_options(cls, options)
    return BoundPolicy(name, cls, dict(options))


def _raise_load_failure(manager: Any, entrypoint: Any, exc: BaseException) -> None:
    raise PolicyNotFoundError(f"policy entry point {entrypoint} failed to load: {exc}") from exc
