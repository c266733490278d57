"""Layer-wise streamed loads: the value types both sides of a stream share.

A streamed load (`LayerStreams.stream_slots`) hands out, per block, a slot
in a shared arena at once, and the blocks' bytes land in those slots layer
by layer (a block's payload is layer-major: layer l of a block of `size`
bytes is bytes [l * size / layers, (l + 1) * size / layers)). Progress is
published in *progress words*, one unsigned 32-bit word per block plus one
for the stream:

- word i (block i): how many layers of block i, counted from layer 0, are
  in its slot and verified; `FAILED` once any of its layers failed (or it
  was missing): it is a miss and is never written again;
- word n (the stream): 0 while the cache still works on it, `FINISHED`
  once every block's word is final (a block DONE at the end is one whose
  every layer landed and that is now leased to the stream).

The words live in process memory for an in-process cache and in a
shared-memory file beside the arena for the service (ucm/service/progress.py),
so a reader in another process polls them without a round trip. Words are
written only by the cache, after the bytes they announce (a GIL hand-over,
hence a full barrier, lies between the copy and the store); readers load
the word before they copy the bytes (x86-64 keeps loads in order).

`wait_layer` is bounded by its timeout and a dead writer (service gone)
turns every unfinished block into a miss: no wait hangs.
"""
from __future__ import annotations

import abc
import threading
import time
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from ucm.api import Key, Outcome

FAILED = 0xFFFFFFFF
FINISHED = 1


def word_count(blocks: int) -> int:
    """Progress words of a stream of `blocks` blocks."""
    return blocks + 1


class LayerStream(abc.ABC):
    """One streamed load, owned by its reader. `arena` is the buffer the
    slots index; `slots[i]` is block i's (offset, length) in it, or None
    on a miss. Call `release` exactly once when done copying."""

    arena: Any
    slots: list[Optional[tuple[int, int]]]
    layers: int

    @abc.abstractmethod
    def wait_layer(self, layer: int, timeout_s: float) -> list[bool]:
        """Waits (at most `timeout_s`) until layer `layer` of every block has
        landed or failed; per block, whether its bytes of that layer are in
        its slot, verified. A block False here stays a miss."""

    @abc.abstractmethod
    def outcomes(self, timeout_s: float) -> list[Outcome]:
        """Waits (at most `timeout_s`) until the stream is finished; per
        block DONE when every layer landed and the block is leased to this
        stream, else MISSING / CORRUPT / FAILED."""

    @abc.abstractmethod
    def release(self) -> None:
        """Gives the stream's slots back (its blocks may be evicted again)."""


@runtime_checkable
class LayerStreams(Protocol):
    """Ability of a cache (UnifiedCache, CacheClient): streamed loads."""

    def stream_slots(self, keys: Sequence[Key], sizes: Sequence[int], layers: int,
                     request_id: Optional[str] = None) -> LayerStream:
        """Starts loading `keys` into slots of the landing tier, layer by
        layer (every layer's reads in flight at once, layer 0 first); blocks
        already in the landing tier are there at once. Never raises for a
        cache fault: a block that cannot be served is FAILED in its word."""


class WordView:
    """Reads of a stream's progress words (a memoryview of 'I' items)."""

    __slots__ = ("words", "n", "layers")

    def __init__(self, words: memoryview, n: int, layers: int) -> None:
        self.words = words
        self.n = n
        self.layers = layers

    def landed(self, layer: int) -> Optional[list[bool]]:
        """Per block whether `layer` landed, or None while some block is
        still below it."""
        w = self.words
        out = []
        for i in range(self.n):
            v = w[i]
            if v == FAILED:
                out.append(False)
            elif v > layer:
                out.append(True)
            else:
                return None
        return out

    def finished(self) -> bool:
        return self.words[self.n] == FINISHED

    def final(self) -> list[Outcome]:
        return [Outcome.DONE if self.words[i] == self.layers else Outcome.MISSING for i in range(self.n)]


class StreamProgress(WordView):
    """The writer side of a stream's words, with a condition for waiters in
    the same process. Methods are called by the cache's threads."""

    __slots__ = ("cond", "_have")

    def __init__(self, words: memoryview, n: int, layers: int) -> None:
        super().__init__(words, n, layers)
        for i in range(n + 1):
            words[i] = 0
        self.cond = threading.Condition()
        self._have: list[set[int]] = [set() for _ in range(n)]  # layers landed out of order

    def layer_landed(self, i: int, layer: int) -> None:
        with self.cond:
            w = self.words
            if w[i] == FAILED:
                return
            have = self._have[i]
            have.add(layer)
            v = w[i]
            while v in have:
                have.discard(v)
                v += 1
            if v != w[i]:
                w[i] = v
                self.cond.notify_all()

    def all_landed(self, i: int) -> None:
        with self.cond:
            if self.words[i] != FAILED:
                self.words[i] = self.layers
                self._have[i].clear()
                self.cond.notify_all()

    def fail(self, i: int) -> None:
        with self.cond:
            self.words[i] = FAILED
            self._have[i].clear()
            self.cond.notify_all()

    def finish(self, done: Sequence[bool]) -> None:
        """Final: blocks not `done` become FAILED, then the stream word."""
        with self.cond:
            for i, ok in enumerate(done):
                if not ok or self.words[i] != self.layers:
                    self.words[i] = FAILED
            self.words[self.n] = FINISHED
            self.cond.notify_all()

    def wait_landed(self, layer: int, timeout_s: float) -> list[bool]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                got = self.landed(layer)
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return [self.words[i] != FAILED and self.words[i] > layer for i in range(self.n)]
                self.cond.wait(left)

    def wait_finished(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not self.finished():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True
