"""Placement: what to admit, where to put it, what to demote or evict.

base.py declares the one engine interface (`PlacementEngine`); engine.py is
the Python reference engine and native.py the C++ one, and factory.py's
`make_placement` picks between them. plans.py is the vocabulary both sides
of the tier stack speak (Op, Step, Plan, TierSpec); heat.py the per-block
access history; policies/ the pluggable policies (`ucm.policies` entry
points).
"""
from ucm.placement.base import PlacementEngine
from ucm.placement.factory import Placement, make_placement
from ucm.placement.plans import Decision, Op, Plan, RunDecision, Step, TierCounters, TierSpec

__all__ = ["Decision", "Op", "Placement", "PlacementEngine", "Plan", "RunDecision", "Step", "TierCounters",
           "TierSpec", "make_placement"]
