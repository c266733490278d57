"""`mooncake`: blocks in a Mooncake Store, the memory pool shared by a cluster.

The adapter is `adapter.MooncakeAdapter` (its docstring describes the pool,
values, space and faults); `codes` holds its config and the store's error
codes, `session` its client joined to the master (setup, health probes,
registered memory), `recovery` the removal of objects held at dead nodes,
`scratch` its registered scratch memory and the chunking of batches into
store calls. The entry point is `ucm.adapters.mooncake:MooncakeAdapter`.
"""
from ucm.adapters.mooncake.adapter import MooncakeAdapter
from ucm.adapters.mooncake.codes import MooncakeConfig

__all__ = ["MooncakeAdapter", "MooncakeConfig"]
