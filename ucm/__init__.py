"""ucm: a unified cache manager for LLM inference KV caches.

Keeps computed KV blocks in a hierarchy of tiers (HBM, DRAM, NVMe, cluster)
and hands them back to inference engines so that prefill is skipped.
"""
__version__ = "0.1.0"

__all__ = ["__version__", "connect"]


def connect(config=None, start=True):
    """A CacheClient of this node's service for `config` (a YAML path, a
    mapping or a UcmConfig), starting a private service when none runs."""
    from ucm.service.client.spawn import connect as _connect

    return _connect(config, start=start)
