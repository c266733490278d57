"""nvme write buffers, and the write of one sealed region to the medium.

A `WriteBuffer` is one region's worth of memory: `put` appends blocks into
it (readable from memory at once), and once full it is sealed: the sealer
thread (`ucm-nvme-sealer`, in the adapter) calls `write_region`, which
invalidates the region's old trailer, writes the data in `io_chunk` pieces
all in flight, then the footer. A crash at any instant leaves the region
with a valid footer describing intact data, or with none.

`write_region` runs without the adapter's lock and touches only the buffer
(whose `readers` and `sealing` fields the adapter guards) and the device.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from ucm.adapters.nvme import format as fmt
from ucm.adapters.nvme.format import ALIGN, FooterEntry


@dataclass(slots=True)
class WriteBuffer:
    mem: mmap.mmap
    view: memoryview
    region: int = -1
    seq: int = 0
    end: int = 0  # bytes of data appended
    entries: list[FooterEntry] = field(default_factory=list)
    n_chunks: int = 0  # chunks of the entries' blocks together (the footer's chunk tables)
    readers: int = 0
    sealing: bool = False


def write_region(io: Any, fd: int, buf: WriteBuffer, entries: list, invalidate: bool, region_size: int,
                 io_chunk: int) -> int:
    """Writes one region through the device `io`: invalidate the old
    trailer (`invalidate`: one may be on the medium), data, then footer.
    Returns 0 or -errno."""
    rs = region_size
    base = buf.region * rs
    fbytes = fmt.footer_bytes(len(entries), sum(len(e.chunks) for e in entries) // fmt.CHUNK_SUM)
    if invalidate:
        zero = mmap.mmap(-1, ALIGN)
        r = io.write_batch(fd, [zero], [base + rs - ALIGN])[0]
        zero.close()
        if r != ALIGN:
            return r if r < 0 else -errno.EIO
    if not stat.S_ISBLK(os.fstat(fd).st_mode):
        try:
            os.posix_fallocate(fd, base, rs)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
    views = [buf.view[c:min(buf.end, c + io_chunk)] for c in range(0, buf.end, io_chunk)]
    results = io.write_batch(fd, views, [base + c for c in range(0, buf.end, io_chunk)])
    for v, r in zip(views, results):
        if r != len(v):
            for w in views:
                w.release()
            return r if r < 0 else -errno.ENOSPC
    for v in views:
        v.release()
    # Footer: entries, then the trailer in the region's last bytes.
    foot = buf.view[rs - fbytes:rs]
    fmt.encode_footer_into(foot, entries, buf.seq, buf.region, rs)
    r = io.write_batch(fd, [foot], [base + rs - fbytes])[0]
    foot.release()
    if r != fbytes:
        return r if r < 0 else -errno.ENOSPC
    return 0
