"""`nvme`: a log-structured region store on a directory or a block device,
laid out as CacheLib's Navy block cache is:

- `format`: the on-disk footer and trailer codec and its decoding at
  recovery (pure functions);
- `regions`: the region table's records and the choice of a victim;
- `writer`: region write buffers and the write of one sealed region;
- `reclaim`: reading a victim region's live blocks back into a new buffer;
- `adapter`: `NvmeAdapter`, which ties them together under one lock (its
  docstring describes layout, writes, reads, space, restart and threads).

The entry point is `ucm.adapters.nvme:NvmeAdapter`.
"""
from ucm.adapters.nvme.adapter import FILE_NAME, NvmeAdapter, NvmeConfig

__all__ = ["FILE_NAME", "NvmeAdapter", "NvmeConfig"]
