"""Placement policies: admission, eviction order and promotion per tier."""
from ucm.placement.policies.base import Admission, PlacementPolicy, TierInfo, load_policy

__all__ = ["Admission", "PlacementPolicy", "TierInfo", "load_policy"]
