"""ScratchPool: page-aligned scratch memory kept warm for the next read.

Reads that cannot land in their destination directly go through scratch:
an O_DIRECT read of a block whose length is not a multiple of 4 KiB (every
frame of a codec tier), the frames a codec tier verifies before it decodes
them. A fresh anonymous mapping per read costs a page fault and a zeroed
page per 4 KiB on first touch, and its unmapping, several times what a
read into memory used before costs (docs/lab/benchmarks.md, "warm scratch
for the codec tier's reads").

`lease(n)` hands out a mapping of at least n bytes and takes it back when
the block exits: the smallest idle one that fits, else a new one (rounded
up to GRAIN). At most `keep` idle mappings of at most `max_bytes` each are
kept; a larger request gets a mapping of its own, unmapped on return.
Thread-safe; each lease is one caller's alone.
"""
from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager
from typing import Iterator

GRAIN = 1 << 20


class ScratchPool:
    def __init__(self, keep: int = 2, max_bytes: int = 32 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.made = 0  # mappings created: a warm pool stops making them

    def _take(self, n: int) -> mmap.mmap:
        with self._lock:
            fits = [m for m in self._idle if len(m) >= n]
            if fits:
                m = min(fits, key=len)
                self._idle.remove(m)
                return m
            self.made += 1
        return mmap.mmap(-1, max(GRAIN, -(-n // GRAIN) * GRAIN) if n <= self.max_bytes else n)

    def _give(self, m: mmap.mmap) -> None:
        with self._lock:
            if len(m) <= self.max_bytes:
                self._idle.append(m)
                self._idle.sort(key=len, reverse=True)
                m = self._idle.pop() if len(self._idle) > self.keep else None  # the smallest goes
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view still exported: unmapped when the last one goes
                pass

    @contextmanager
    def lease(self, n: int) -> Iterator[mmap.mmap]:
        """A page-aligned mapping of at least `n` bytes (its contents are
        whatever the last lease left), for the block's duration. Views of
        it must not outlive the block."""
        m = self._take(max(1, n))
        try:
            yield m
        finally:
            self._give(m)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for m in idle:
            try:
                m.close()
            except BufferError:
                pass
