"""Accelerators: modules on top of the cache API (prefetch, compression,
sparse attention), called at the hook points of `ucm.accelerators.base`."""
