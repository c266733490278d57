"""ucm: a unified cache manager for LLM inference KV caches.

Keeps computed KV blocks in a hierarchy of tiers (HBM, DRAM, NVMe, cluster)
and hands them back to inference engines so that prefill is skipped.
"""
__version__ = "0.1.0"

__all__ = ["__version__"]
