"""The mooncake adapter's scratch memory and how a batch is cut into store calls.

Scratch. One anonymous mapping, registered with the store client, split into
`concurrency` areas: one per call moving data at once. An area is `SLOTS`
header slots of `SLOT` bytes (each block's framing header travels from or
into one) followed by a staging share (payloads of buffers the transfer
engine may not touch are copied through it). A call takes an area
(`ScratchAreas.take`, waiting up to `wait_s`) and gives it back when its
transfers have ended (`give`).

Chunking. `chunks` cuts a batch into store calls of at most `chunk_bytes`,
each using half of an area's slots and staging, so that two calls can be in
flight (chunk k uses half k % 2) while the caller checksums, stages or
verifies the other.

Thread-safe: the area queue is a `queue.Queue`; an area belongs to one call
at a time.
"""
from __future__ import annotations

import mmap
import queue
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from ucm import _native

SLOT = 64  # bytes per header slot in the scratch memory
SLOTS = 256  # header slots per scratch area: items per store call


def address(view: memoryview) -> int:
    """The address of a buffer's first byte (0 for an empty one)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


@dataclass(slots=True)
class Area:
    """One concurrent call's share of the registered scratch memory."""

    headers: memoryview
    headers_addr: int
    staging: memoryview
    staging_addr: int


class ScratchAreas:
    """`concurrency` areas of one prefaulted mapping, handed out one per call."""

    def __init__(self, staging_size: int, concurrency: int) -> None:
        self.staging_share = (staging_size // concurrency) & ~63  # staging bytes per area
        area_bytes = SLOTS * SLOT + self.staging_share
        self._mem = mmap.mmap(-1, area_bytes * concurrency)
        _native.prefault(self._mem)
        self.view = memoryview(self._mem)
        self.address = address(self.view)
        self._count = concurrency
        self._held: list[Area] = []  # taken back for good by take_all
        self._free: queue.Queue[Area] = queue.Queue()
        for a in range(concurrency):
            off = a * area_bytes
            head = off + SLOTS * SLOT
            self._free.put(Area(self.view[off:head], self.address + off,
                                self.view[head:off + area_bytes], self.address + head))

    def take(self, timeout_s: float) -> Optional[Area]:
        """A free area, or None if none came free within `timeout_s`."""
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def give(self, area: Area) -> None:
        self._free.put(area)

    def take_all(self, timeout_s: float) -> bool:
        """Takes every area back (waits for the calls still moving data),
        so that none is handed out again. False if one did not come back
        within `timeout_s` each: then the mapping must stay (a transfer may
        still use it)."""
        for _ in range(self._count - len(self._held)):
            area = self.take(timeout_s)
            if area is None:
                return False
            self._held.append(area)
        return True

    def unmap(self) -> None:
        """Unmaps the scratch memory; after `take_all` returned True."""
        for area in self._held:
            area.headers.release()
            area.staging.release()
        self._held.clear()
        try:
            self.view.release()
            self._mem.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes with the process


def chunks(area: Area, views: Sequence[memoryview], idx: Sequence[int], chunk_bytes: int,
           direct: Callable[[memoryview, int], bool]) -> Iterator[list[tuple]]:
    """Splits items `idx` of `views` into store calls of at most
    `chunk_bytes` (and half the area's header slots and staging, so that two
    calls can be in flight: chunk k uses half k % 2). `direct(view, addr)`:
    whether the transfer engine may move that buffer itself. Per item:
    (item, header slot, payload address, or None if staged, staging offset)."""
    room = len(area.staging) // 2 & ~63
    slots = SLOTS // 2
    chunk: list[tuple] = []
    k = nbytes = staged = 0
    for i in idx:
        v = views[i]
        addr = address(v)
        here = not len(v) or direct(v, addr)
        if chunk and (len(chunk) == slots or nbytes + len(v) > chunk_bytes or (not here and staged + len(v) > room)):
            yield chunk
            chunk, k, nbytes, staged = [], k + 1, 0, 0
        slot = (k % 2) * slots + len(chunk)
        if here:
            chunk.append((i, slot, addr, 0))
        else:
            chunk.append((i, slot, None, (k % 2) * room + staged))
            staged += (len(v) + 63) & ~63
        nbytes += len(v)
    if chunk:
        yield chunk
