"""Placement: what to admit, where to put it, what to demote or evict.

plans.py is the vocabulary both sides of the tier stack speak (Op, Step,
Plan, TierSpec); heat.py the per-block access history; policies/ the
pluggable policies (`ucm.policies` entry points); engine.py the Python
reference engine and native.py the C++ one, chosen by one factory.
"""
from ucm.placement.engine import Placement
from ucm.placement.plans import Decision, Op, Plan, RunDecision, Step, TierCounters, TierSpec

__all__ = ["Decision", "Op", "Placement", "Plan", "RunDecision", "Step", "TierCounters", "TierSpec"]
