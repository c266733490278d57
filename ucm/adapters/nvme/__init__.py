"""`nvme`: a log-structured region store on a directory or a block device,
laid out as CacheLib's Navy block cache is:

- `config`: `NvmeConfig`, the adapter's options;
- `format`: the on-disk footer and trailer codec and its decoding at
  recovery (pure functions);
- `regions`: the region table's records and the choice of a victim;
- `writer`: region write buffers and the write of one sealed region;
- `reclaim`: reading a victim region's live blocks back into a new buffer;
- `reads`: the read path (`get`, `get_range`), a mixin of the adapter;
- `recovery`: opening the medium and rebuilding the index at restart, a
  mixin of the adapter;
- `adapter`: `NvmeAdapter`, which ties them together under one lock (its
  docstring describes layout, writes, reads, space, restart and threads).

The entry point is `ucm.adapters.nvme:NvmeAdapter`.
"""
from ucm.adapters.nvme.adapter import NvmeAdapter
from ucm.adapters.nvme.config import NvmeConfig
from ucm.adapters.nvme.recovery import FILE_NAME

__all__ = ["FILE_NAME", "NvmeAdapter", "NvmeConfig"]
