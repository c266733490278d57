"""NativePlacement: `PlacementEngine` (ucm/placement/base.py) on the C++
placement core.

`make_placement` (ucm/placement/factory.py) builds one of these when the
policy has a native twin (a policy class that declares `native`, loaded
with `load_policy` and no options; see ucm/placement/policies/base.py) and
the HeatTracker it is given has no history yet (`unavailable` says why
not). The core (cpp/src/placement.cpp, bound as
`ucm._native.PlacementCore`) keeps the tier membership, sizes, the prefix
tree, pins, holds and the policy's queues, and makes exactly the decisions
of the Python reference engine (ucm/placement/engine.py;
tests/unit/test_placement_native.py compares every plan). This class
converts: keys (bytes) and plans cross once per call, a batched call
(`record_request`, `insert_run`, `touch`) once per request.
`resident_keys` answers a list (a snapshot), `counters` a snapshot too.

The HeatTracker stays the Python one, updated by `record_request` as on the
Python path (the cache and the replay read its clock and records); the core
keeps its own copy of what the native policies read from it (the parent
links, with the same history bound, and the clock), so every access must
reach the tracker through this placement's `record_request`.

`watch` callbacks run synchronously, in order, before the call that linked
or unlinked the keys returns (the core records the events; they are
delivered here, never from C++).

Not thread-safe: the owner serialises calls (as on the Python path).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.heat import HeatTracker, Key
from ucm.placement.plans import (Decision, Op, Plan, RunDecision, Step, TierCounters, TierSpec, check_next_uses,
                                check_tiers)
from ucm.placement.policies.base import BoundPolicy, PolicyFactory

_OPS = [Op.WRITE, Op.MOVE, Op.COPY, Op.DROP]  # the order of ucm::StepOp


def _native_policies() -> frozenset[str]:
    try:
        from ucm import _native
    except ImportError:
        return frozenset()
    return frozenset(_native.placement_policies())


MAX_TIERS = 8  # PlacementCore::kMaxTiers


def unavailable(policy: PolicyFactory, heat: Optional[HeatTracker], tiers: int = 1) -> Optional[str]:
    """Why `policy` with `heat` over `tiers` tiers cannot run on the native
    core, or None if it can."""
    if tiers > MAX_TIERS:
        return f"{tiers} tiers, the native core takes at most {MAX_TIERS}"
    if not isinstance(policy, BoundPolicy):
        return f"the policy factory {policy!r} is not a BoundPolicy from load_policy"
    name = policy.native
    if name is None:
        return f"policy {policy.name!r} has no native twin (or takes options)"
    if name not in _native_policies():
        return f"policy {policy.name!r} names native twin {name!r}, which ucm._native lacks"
    if heat is not None and (heat.now != 0 or len(heat) != 0):
        return "the HeatTracker already has history (the core must see every access)"
    return None


def _keys(keys: Iterable[Key]) -> Sequence[Key]:
    return keys if isinstance(keys, (list, tuple)) else list(keys)


class NativePlacement:
    """`PlacementEngine` on the C++ core (module docstring)."""

    native = True  # this engine runs on the C++ core

    def __init__(
        self,
        tiers: Sequence[TierSpec],
        policy: PolicyFactory,
        heat: Optional[HeatTracker] = None,
        landing: int = 0,
    ) -> None:
        from ucm import _native

        check_tiers(tiers, landing)
        why = unavailable(policy, heat, len(tiers))
        if why is not None:
            raise ArgumentError(f"native placement unavailable: {why}")
        self.heat = heat if heat is not None else HeatTracker()
        self.landing = landing
        self._names = [spec.name for spec in tiers]
        self._core = _native.PlacementCore(
            tiers=[(spec.name, spec.capacity_bytes) for spec in tiers], policy=policy.native,
            history_blocks=self.heat.history_blocks, landing=landing, step_type=Step, ops=_OPS)
        self._on_link: Optional[Callable[[Key], None]] = None
        self._on_unlink: Optional[Callable[[Key], None]] = None

    # ---- queries -----------------------------------------------------------
    @property
    def tier_count(self) -> int:
        return len(self._names)

    def tier_name(self, t: int) -> str:
        return self._names[t]

    def capacity_bytes(self, t: int) -> int:
        return self._core.capacity_bytes(t)

    def used_bytes(self, t: int) -> int:
        return self._core.used_bytes(t)

    def blocks(self, t: int) -> int:
        return self._core.blocks(t)

    def counters(self, t: int) -> TierCounters:
        """A snapshot of tier t's counters."""
        return TierCounters(*self._core.counters(t))

    def contains(self, key: Key) -> bool:
        return self._core.contains(key)

    def tiers_of(self, key: Key) -> list[int]:
        return self._core.tiers_of(key)

    def where(self, key: Key) -> Optional[int]:
        return self._core.where(key)

    def lookup(self, keys: Sequence[Key]) -> int:
        return self._core.lookup(keys)

    def locate(self, keys: Sequence[Key]) -> list[Optional[int]]:
        return self._core.locate(keys)

    def size_of(self, key: Key) -> Optional[int]:
        return self._core.size_of(key)

    def parent_of(self, key: Key) -> Optional[Key]:
        return self._core.parent_of(key)

    def resident_keys(self, t: int) -> Iterable[Key]:
        return self._core.resident_keys(t)

    # ---- pins and holds ------------------------------------------------------
    def pin(self, keys: Iterable[Key]) -> None:
        self._core.pin(_keys(keys))

    def unpin(self, keys: Iterable[Key]) -> None:
        self._core.unpin(_keys(keys))

    def hold(self, keys: Iterable[Key]) -> None:
        self._core.hold(_keys(keys))

    def unhold(self, keys: Iterable[Key]) -> None:
        self._core.unhold(_keys(keys))

    # ---- accesses ----------------------------------------------------------
    def record_request(self, keys: Sequence[Key], next_uses: Optional[Sequence[float]] = None,
                       parent: Optional[Key] = None) -> None:
        check_next_uses(keys, next_uses)  # before the tracker records anything
        heat = self.heat  # the HeatTracker, as on the Python path
        heat.tick()
        heat.touch_request(keys, parent, next_uses)
        self._core.record_request(keys, parent, next_uses)

    def finish_request(self, keys: Sequence[Key], output_tokens: int) -> None:
        keys = _keys(keys)
        self.heat.finish(keys, output_tokens)
        self._core.finish_request(keys, output_tokens)

    def touch(self, keys: Sequence[Key]) -> None:
        self._core.touch(keys)

    # ---- changes -----------------------------------------------------------
    def insert(self, key: Key, parent: Optional[Key], size_bytes: int,
               tier: Optional[int] = None, restored: bool = False) -> Decision:
        if size_bytes <= 0:
            raise ArgumentError(f"size_bytes must be > 0, got {size_bytes}")
        placed, plan = self._core.insert(key, parent, size_bytes, self.landing if tier is None else tier, restored)
        if self._on_link is not None:
            self._deliver()
        return Decision(placed, plan)

    def insert_run(self, keys: Sequence[Key], parent: Optional[Key], sizes: Sequence[int],
                   tier: Optional[int] = None) -> RunDecision:
        placed, plan, stop = self._core.insert_run(keys, parent, sizes, self.landing if tier is None else tier)
        if self._on_link is not None:
            self._deliver()
        return RunDecision(placed, plan, stop)

    def promote(self, key: Key, force: bool = False) -> Decision:
        placed, plan = self._core.promote(key, force)
        if self._on_link is not None:
            self._deliver()
        return Decision(placed, plan)

    def reclaim(self, t: int, free_bytes: int, max_victims: int) -> Plan:
        plan = self._core.reclaim(t, free_bytes, max_victims)
        if self._on_link is not None:
            self._deliver()
        return plan

    def may_evict(self, t: int, keys: Iterable[Key], protect: Optional[Key] = None,
                  relaxed: bool = False) -> bool:
        return self._core.may_evict(t, _keys(keys), protect, relaxed)

    def evict_keys(self, t: int, keys: Iterable[Key], any_one: bool = False,
                   protect: Optional[Key] = None, relaxed: bool = False) -> Plan:
        plan = self._core.evict_keys(t, _keys(keys), any_one, protect, relaxed)
        if self._on_link is not None:
            self._deliver()
        return plan

    def remove(self, key: Key, tier: Optional[int] = None) -> Plan:
        if tier is not None and not 0 <= tier < len(self._names):
            raise IndexError(f"tier index {tier} outside 0..{len(self._names) - 1}")
        plan = self._core.remove(key, -1 if tier is None else tier)
        if self._on_link is not None:
            self._deliver()
        return plan

    def watch(self, on_link: Callable[[Key], None], on_unlink: Callable[[Key], None]) -> None:
        for key in self._core.cached_keys():
            on_link(key)
        self._on_link, self._on_unlink = on_link, on_unlink
        self._core.watch_events(True)

    def _deliver(self) -> None:
        on_link, on_unlink = self._on_link, self._on_unlink
        for linked, key in self._core.take_events():
            (on_link if linked else on_unlink)(key)
