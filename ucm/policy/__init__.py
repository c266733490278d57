"""Placement policies: admission, eviction order and promotion per tier."""
from ucm.policy.base import Admission, PlacementPolicy, TierInfo, load_policy

__all__ = ["Admission", "PlacementPolicy", "TierInfo", "load_policy"]
