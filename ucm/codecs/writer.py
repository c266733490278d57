"""WriteBehind: the codec tier's queue of demoted blocks, and the thread
that writes them.

`submit` copies a block and returns; one thread (`ucm-codec-writer`, one
per tier, first in first out, at nice WRITER_NICE) hands each copy to the
tier's `write` (encode, then the medium's put). A demotion therefore costs
its caller one copy, never an encode. The copies waiting are bounded
(WRITE_BEHIND_BYTES; a submit past the bound waits for room). A block
still waiting answers `size_of` and `waiting`; `wait_written` returns
once it settled, so a reader reads the medium, never the raw copy of a
lossy codec. `cancel` (a delete) keeps a waiting block from being written,
or has it deleted again (`undo`) if its write was already under way. A
write that does not end OK (and was not cancelled) is reported to
`failed`. Once `close` began, `submit` refuses (the caller writes on its
own thread) and the thread ends after the queue is empty.

The callbacks run on the writer thread, outside this queue's lock (a
leaf: nothing else is called under it).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ucm.adapters.base import Key, Status

log = logging.getLogger(__name__)

# Raw bytes of demoted blocks copied and waiting for the writer thread at
# most; a submit beyond waits for room (a full DRAM tier's staging of a
# 23-block prompt of 2.95 MB blocks demotes 68 MB).
WRITE_BEHIND_BYTES = 128 << 20

# The writer thread's nice value (Linux: a thread's own): encoding demoted
# blocks is behind every caller, so it yields the cores to the reads and
# the engine's forward beside it (2 cores: the encode of a hit's demoted
# victims ran against vLLM's forward).
WRITER_NICE = 10


@dataclass(eq=False, slots=True)
class _Pending:
    """A block submitted and not settled yet (queued or being written)."""

    key: Key
    raw: bytearray
    parent: Optional[Key]
    written: threading.Event = field(default_factory=threading.Event)  # set once settled (written or not)
    cancelled: bool = False  # deleted meanwhile: not written, or deleted again once written


class WriteBehind:
    """The write-behind queue of one codec tier (see the module docstring).

    write(key, raw, parent) -> Status: stores one block (on the writer
    thread). undo(key, still_waiting): a cancelled block was written after
    all; delete it (`still_waiting`: the key was submitted again meanwhile).
    failed(key): a write did not end OK and the block was not cancelled."""

    def __init__(self, name: str, write: Callable[[Key, bytearray, Optional[Key]], Status],
                 undo: Callable[[Key, bool], None], failed: Callable[[Key], None]) -> None:
        self.name = name
        self._write = write
        self._undo = undo
        self._failed = failed
        self._cond = threading.Condition()
        self._pending: dict[Key, _Pending] = {}
        self._queue: deque[_Pending] = deque()
        self._pending_bytes = 0
        self._waits = 0  # submits that waited for room
        self._thread: Optional[threading.Thread] = None
        self._closing = False

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The writer thread, once the first block was submitted."""
        return self._thread

    def submit(self, key: Key, blob: memoryview, parent: Optional[Key]) -> bool:
        """Queues a copy of `blob` under `key` (a block already waiting is
        kept: blobs under a key never change); waits while the queue holds
        WRITE_BEHIND_BYTES. False once `close` began: nothing queued, the
        caller writes the block itself."""
        with self._cond:
            old = self._pending.get(key)
            if old is not None and not old.cancelled:
                return True
            waited = False
            while self._pending_bytes and self._pending_bytes + len(blob) > WRITE_BEHIND_BYTES and not self._closing:
                waited = True
                self._cond.wait()
            self._waits += waited
            if self._closing:
                return False
        entry = _Pending(key, bytearray(blob), parent)  # the copy: the source (a DRAM slot) is freed after
        with self._cond:
            self._pending[key] = entry
            self._queue.append(entry)
            self._pending_bytes += len(blob)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ucm-codec-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def size_of(self, key: Key) -> Optional[int]:
        """The raw size of `key` while it waits, else None."""
        with self._cond:
            entry = self._pending.get(key)
            return len(entry.raw) if entry is not None else None

    def waiting(self, keys: Sequence[Key]) -> list[bool]:
        with self._cond:
            return [k in self._pending for k in keys]

    def wait_written(self, keys: Sequence[Key]) -> None:
        """Returns once none of `keys` waits for the writer."""
        with self._cond:
            waiting = [self._pending[k] for k in keys if k in self._pending]
        for entry in waiting:
            entry.written.wait()

    def cancel(self, key: Key) -> bool:
        """Keeps a waiting `key` from being written (or has it undone once
        written); True if it was waiting."""
        with self._cond:
            entry = self._pending.pop(key, None)
            if entry is not None:
                entry.cancelled = True
            return entry is not None

    def wait_idle(self, timeout_s: float) -> bool:
        """True once every submitted block settled, False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_bytes, timeout_s)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"codec_pending_blocks": len(self._pending), "codec_write_behind_waits": self._waits}

    def close(self) -> None:
        """Lets the thread write what is queued, then joins it."""
        with self._cond:
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        """The writer thread: the queued blocks in submit order. A block
        cancelled meanwhile is not written (or undone once written); one
        whose write does not end OK is reported to `failed`."""
        _lower_priority(WRITER_NICE)
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                entry = self._queue.popleft()
                skip = entry.cancelled
            st = Status.FAILED
            try:
                if not skip:
                    st = self._write(entry.key, entry.raw, entry.parent)
            except Exception:  # a medium that raises: the block is dropped, never the writer
                log.exception("ucm: writing a block to tier %s failed", self.name)
            with self._cond:
                if self._pending.get(entry.key) is entry:
                    del self._pending[entry.key]
                cancelled = entry.cancelled
                again = entry.key in self._pending  # submitted again meanwhile
            if cancelled and st is Status.OK:
                self._undo(entry.key, again)
            elif st is not Status.OK and not cancelled:
                self._failed(entry.key)
            with self._cond:
                self._pending_bytes -= len(entry.raw)
                self._cond.notify_all()
            entry.raw = bytearray()
            entry.written.set()


def _lower_priority(nice: int) -> None:
    """Raises this thread's nice value to `nice` where the OS has one per
    thread (Linux); elsewhere, or if refused, the thread runs as it was."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass
