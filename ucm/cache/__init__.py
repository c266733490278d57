"""The in-process cache: `UnifiedCache`, the one API over a stack of tiers.

unified.py holds the class: it opens the tiers and hands work to its parts,
each an object acting on one CacheCore (core.py: the tiers, the placement
engine, the plan executor, the metadata lock, the request bookkeeping, the
counters of counters.py): blocks.py (whole-block store and load),
staging.py (blocks below the landing tier copied up), slots.py (zero-copy
slot access), streaming.py (layer-wise streamed loads), ranges.py (range
reads) and reclaim.py (headroom).
"""
from ucm.cache.unified import Handle, Outcome, TierFactory, UnifiedCache

__all__ = ["Handle", "Outcome", "TierFactory", "UnifiedCache"]
