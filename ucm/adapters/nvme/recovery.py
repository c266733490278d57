"""The nvme adapter's start: the medium opened (`_open`: the region file in
a directory, or a block device; O_DIRECT unless the file system refuses
it) and the index rebuilt from the regions' trailers and footers alone
(`_recover`, no payload reads).

A mixin of NvmeAdapter (ucm/adapters/nvme/adapter.py), called from its
constructor, before the sealer thread starts: `_recover` fills the adapter's
index, regions, free list, sequence number and counters. Trailers are read
in batches into one buffer, footers longer than a page in batches into
another; where a key is in several regions the newest wins; a region whose
footer is refused (garbage, torn, another format version) counts as empty.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
from typing import Any

from ucm.adapters.base import Key
from ucm.adapters.nvme import format as fmt
from ucm.adapters.nvme.format import ALIGN, FooterEntry, Refused
from ucm.adapters.nvme.regions import Loc
from ucm.errors import AdapterError

log = logging.getLogger("ucm.adapters.nvme.adapter")  # the adapter's messages, as before the split

FILE_NAME = "ucm-regions.dat"

_TRAILER_BATCH = 2048  # region trailers read per batch at recovery (one 8 MiB buffer)
_FOOTER_BATCH_BYTES = 8 << 20  # footers longer than a page, read per batch at recovery


class NvmeRecovery:
    """_open and _recover of NvmeAdapter; see the module docstring."""

    def _open(self, path: str, capacity_bytes: int) -> tuple[str, int, bool, int]:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.stat(path)
        except OSError as exc:
            raise AdapterError(f"nvme: cannot use path {path!r}: {exc}") from exc
        block_device = stat.S_ISBLK(st.st_mode)
        target = path if block_device else os.path.join(path, FILE_NAME)
        flags = os.O_RDWR | (0 if block_device else os.O_CREAT)
        direct = self.config.direct_io
        try:
            fd = os.open(target, flags | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                log.warning("nvme: %s refuses O_DIRECT; using buffered I/O", target)
                direct = False
                fd = os.open(target, flags, 0o600)
            else:
                raise AdapterError(f"nvme: cannot open {target!r}: {exc}") from exc
        medium = capacity_bytes
        if block_device:
            medium = min(capacity_bytes, os.lseek(fd, 0, os.SEEK_END))
        return target, fd, direct, medium

    def _recover(self) -> None:
        """Rebuilds the index from region trailers and footers. Trailers are
        read in batches into one buffer, and footers longer than the page
        read with the trailer in batches into another, so a medium of any
        number of regions opens with two mappings and few I/O batches."""
        rs = self.config.region_size
        st = os.fstat(self._fd)
        size = self.n_regions * rs if stat.S_ISBLK(st.st_mode) else st.st_size
        present = min(self.n_regions, size // rs)
        found: list[tuple[int, fmt.Trailer, tuple[FooterEntry, ...]]] = []
        long: list[tuple[int, fmt.Trailer]] = []  # footers longer than the page read with the trailer
        refused: dict[Refused, int] = {}
        if present:
            batch = min(present, _TRAILER_BATCH)
            tails = mmap.mmap(-1, batch * ALIGN)
            whole = memoryview(tails)
            views = [whole[i * ALIGN:(i + 1) * ALIGN] for i in range(batch)]
            try:
                for start in range(0, present, batch):
                    m = min(batch, present - start)
                    res = self._io.read_batch(self._fd, views[:m], [(start + i + 1) * rs - ALIGN for i in range(m)])
                    for i in range(m):
                        if res[i] != ALIGN:
                            self._stats["read_errors"] += 1
                            continue
                        r = start + i
                        t = fmt.decode_trailer(views[i], r, rs)
                        if isinstance(t, Refused):
                            refused[t] = refused.get(t, 0) + 1
                            # any trailer of ours is invalidated before the region is rewritten
                            self._regions[r].has_footer = t is not Refused.EMPTY
                            continue
                        self._regions[r].has_footer = True
                        if t.footer_bytes > ALIGN:
                            long.append((r, t))
                            continue
                        self._accept(r, t, fmt.decode_entries(views[i], t), found, refused)
            finally:
                for v in views:
                    v.release()
                whole.release()
                tails.close()
        if long:
            self._read_long_footers(long, found, refused)
        self._index_found(found)
        self._free_regions = [r for r in range(self.n_regions) if not self._regions[r].live]
        self._free_regions.reverse()  # pop() hands out low regions first
        self._stats["recovered_blocks"] = len(self._index)
        bad = {k.value: v for k, v in refused.items() if k is not Refused.EMPTY}
        if bad:
            log.warning("nvme: %s: regions refused at recovery (treated as empty): %s", self._path, bad)
        if self._index:
            log.info("nvme: recovered %d blocks from %d regions of %s", len(self._index), len(found), self._path)

    def _read_long_footers(self, long: list[tuple[int, fmt.Trailer]],
                           found: list[tuple[int, fmt.Trailer, tuple[FooterEntry, ...]]],
                           refused: dict[Refused, int]) -> None:
        """Reads footers longer than a page, packed into one buffer a batch
        at a time."""
        rs = self.config.region_size
        cap = max(_FOOTER_BATCH_BYTES, max(t.footer_bytes for _, t in long))
        mem = mmap.mmap(-1, cap)
        whole = memoryview(mem)
        try:
            i = 0
            while i < len(long):
                group, used = [], 0
                while i < len(long) and used + long[i][1].footer_bytes <= cap:
                    group.append((long[i], whole[used:used + long[i][1].footer_bytes]))
                    used += long[i][1].footer_bytes
                    i += 1
                res = self._io.read_batch(self._fd, [v for _, v in group],
                                          [(r + 1) * rs - t.footer_bytes for (r, t), _ in group])
                for ((r, t), v), n in zip(group, res):
                    if n != t.footer_bytes:
                        self._stats["read_errors"] += 1
                    else:
                        self._accept(r, t, fmt.decode_entries(v, t), found, refused)
                    v.release()
        finally:
            whole.release()
            mem.close()

    def _accept(self, region: int, trailer: fmt.Trailer, entries: Any,
                found: list[tuple[int, fmt.Trailer, tuple[FooterEntry, ...]]],
                refused: dict[Refused, int]) -> None:
        if isinstance(entries, Refused):
            refused[entries] = refused.get(entries, 0) + 1
        else:
            found.append((region, trailer, entries))

    def _index_found(self, found: list[tuple[int, fmt.Trailer, tuple[FooterEntry, ...]]]) -> None:
        """Indexes the recovered entries: where a key is in several regions
        the newest (highest sequence number) wins."""
        best: dict[Key, tuple[int, int, FooterEntry]] = {}
        for r, t, entries in found:
            self._seq = max(self._seq, t.seq)
            self._regions[r].seq = t.seq
            for e in entries:
                prev = best.get(e.key)
                if prev is None or prev[0] <= t.seq:
                    best[e.key] = (t.seq, r, e)
        for key, (_, r, e) in best.items():
            self._index[key] = Loc(r, e.offset, e.length, e.checksum, e.parent, e.chunk_bytes, e.chunks)
            reg = self._regions[r]
            reg.live.add(key)
            reg.live_bytes += fmt.block_footprint(e.length, len(e.chunks))
