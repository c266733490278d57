"""The service's progress words: per streamed load, one 32-bit word per
block and one for the stream (ucm.layer_stream), in a shared-memory file
beside the arena (mode 0600), so that the engine process that asked for the
stream polls how far each block's layers have landed without a round trip.

The service is the only writer; clients map the file read-only (its path
and size are in `hello`). A stream's words are taken when the stream
starts and given back once the client released it and the cache finished
writing them, never before (a reused word could otherwise be written by
the old stream). First fit over a free list; a full area refuses the
stream (the client then loads whole blocks).

Thread-safe: `alloc` / `free` under one leaf lock.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Optional

from ucm.service.paths import create_segment

WORD = 4


class ProgressArea:
    """The writer side, owned by the service."""

    def __init__(self, directory: str, words: int) -> None:
        self.words = words
        self.nbytes = words * WORD
        self.path, m = create_segment(directory, "progress", self.nbytes)
        self._map: Optional[mmap.mmap] = m
        self._view = memoryview(self._map).cast("I")
        self._free: list[tuple[int, int]] = [(0, words)]  # (first word, count), sorted
        self._lock = threading.Lock()

    def alloc(self, n: int) -> Optional[int]:
        """The first of `n` consecutive free words, or None when none are."""
        with self._lock:
            for i, (at, count) in enumerate(self._free):
                if count >= n:
                    if count == n:
                        del self._free[i]
                    else:
                        self._free[i] = (at + n, count - n)
                    return at
        return None

    def free(self, at: int, n: int) -> None:
        with self._lock:
            self._free.append((at, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for a, c in self._free:
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + c)
                else:
                    merged.append((a, c))
            self._free = merged

    def view(self, at: int, n: int) -> memoryview:
        return self._view[at:at + n]

    def close(self) -> None:
        if self._map is None:
            return
        self._view.release()
        try:
            self._map.close()
        except BufferError:  # a stream's view is still held: the file goes, the mapping with the process
            pass
        self._map = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
