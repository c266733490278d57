"""The in-process cache: `UnifiedCache`, the one API over a stack of tiers.

unified.py holds the class and its lock; its parts are objects of their own
with public seams: slots (zero-copy slot access), ranges (layer-range
reads), staging (below-landing blocks copied up), streaming (layer-wise
streamed loads), counters (`stats`) and reclaim (headroom).
"""
from ucm.cache.unified import Handle, Outcome, TierFactory, UnifiedCache

__all__ = ["Handle", "Outcome", "TierFactory", "UnifiedCache"]
