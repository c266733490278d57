"""make_placement: the one place that picks a placement engine.

Both engines implement `PlacementEngine` (ucm/placement/base.py) and make
the same decisions; the native one (ucm/placement/native.py) keeps the
per-block state in the C++ core and runs only where the policy has a
native twin and the HeatTracker has no history yet
(`unavailable` in native.py says why not). `engine`:
- "auto": native where it can run, else the Python reference engine;
- "native": native, else ArgumentError saying why it cannot run;
- "python": the Python reference engine (ucm/placement/engine.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from ucm.errors import ArgumentError
from ucm.placement.base import PlacementEngine
from ucm.placement.engine import PythonPlacement
from ucm.placement.heat import HeatTracker
from ucm.placement.native import NativePlacement, unavailable
from ucm.placement.plans import TierSpec
from ucm.placement.policies.base import PolicyFactory

ENGINES = ("auto", "native", "python")


def make_placement(tiers: Sequence[TierSpec], policy: PolicyFactory, heat: Optional[HeatTracker] = None,
                   landing: int = 0, *, engine: str = "auto") -> PlacementEngine:
    """A placement engine over `tiers` (fastest first) with one `policy`
    instance per tier, reading and updating `heat` (a new HeatTracker when
    None), new blocks landing in tier `landing`; `engine` as in the module
    docstring."""
    if engine not in ENGINES:
        raise ArgumentError(f"placement engine {engine!r} not one of {list(ENGINES)}")
    if engine != "python":
        why = unavailable(policy, heat, len(tiers))
        if why is None:
            return NativePlacement(tiers, policy, heat, landing)
        if engine == "native":
            raise ArgumentError(f"native placement unavailable: {why}")
    return PythonPlacement(tiers, policy, heat, landing)


def Placement(tiers: Sequence[TierSpec], policy: PolicyFactory, heat: Optional[HeatTracker] = None,
              landing: int = 0, *, native: Optional[bool] = None) -> PlacementEngine:
    """The older spelling of `make_placement`, kept for callers written
    before the engines were split: `native` None, True or False is engine
    "auto", "native" or "python"."""
    engine = "auto" if native is None else "native" if native else "python"
    return make_placement(tiers, policy, heat, landing, engine=engine)
