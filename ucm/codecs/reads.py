"""The codec tier's read path (`CodecReads`, a mixin of CodecAdapter in
ucm/codecs/tier.py, as the nvme adapter's read path is of NvmeAdapter):
`get`, `get_layers` (LayerReads) and `read_ahead` (ReadAhead).

A read takes the frames of a batch from the medium into one warm scratch
mapping (`_read_frames`: padded reads in place where the medium has
PaddedReads), verifies each whole (the frame's checksums) and decodes it
by the codec its id names, the blocks of a batch in parallel on
DECODE_THREADS threads (the checksums and the native decoders release the
GIL). `get_layers` decodes them a range of layers at a time
(`layer_ranges`). `read_ahead` starts such a read on its own thread
before the read is asked for (a staging calls it before the demotions
that free its slots, ucm/tiers/stack.py); the next read of exactly those keys
uses it when it found and read them all.

Its state is the adapter's (`inner`, `_decoders`, `_lock`, `_writes`,
`_scratch`, `_ahead`, `_ahead_pool`, `_ahead_closed`, `_decoders_pool`,
`_count`); no medium and no codec is called under `_lock`.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from ucm.adapters.base import Key, PaddedReads, Status
from ucm.buffers import byte_view
from ucm.codecs import codec_class_by_id
from ucm.codecs.base import Codec, NoneCodec
from ucm.codecs.frame import HEADER_BYTES, verify
from ucm.errors import ArgumentError

log = logging.getLogger(__name__)

# Threads that verify and decode the blocks of one batched read in parallel.
DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))

# Layer ranges a streamed load (`get_layers`) decodes in turn, at most: each
# range is one pass over the batch's blocks. One pass per layer costs more
# than it brings: reading and verifying the frames come first and dominate,
# so the first layer lands no sooner and the last one later (measured in
# docs/lab/benchmarks.md, "Codecs: streamed loads").
LAYER_RANGES = 4


def layer_ranges(layers: int) -> list[tuple[int, int]]:
    """The consecutive layer ranges [first, last) a streamed load of
    `layers` layers decodes in turn: LAYER_RANGES at most, as equal as
    integers allow, earlier ones no larger (the first lands soonest)."""
    if layers < 1:
        raise ArgumentError(f"layer_ranges: layers must be at least 1, got {layers}")
    n = min(LAYER_RANGES, layers)
    bounds = [layers * k // n for k in range(n + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


class CodecReads:
    """The read path of CodecAdapter; see the module docstring."""

    def _decoder(self, codec_id: int) -> Optional[Codec]:
        c = self._decoders.get(codec_id)
        if c is None:
            cls = NoneCodec if codec_id == 0 else codec_class_by_id(codec_id)
            if cls is None:
                return None
            c = self._decoders.setdefault(codec_id, cls())
        return c

    def _open(self, frame: memoryview, out: memoryview) -> Optional[tuple[Codec, memoryview, memoryview]]:
        """(codec, meta, body) of a frame that verifies for `out`, else None (counted)."""
        h = verify(frame)
        if h is None:
            self._count("codec_bad_frames")
            return None
        if h.raw_bytes != len(out):
            self._count("codec_size_mismatch")
            return None
        codec = self._decoder(h.codec_id)
        if codec is None:
            self._count("codec_unknown_id")
            return None
        return codec, frame[HEADER_BYTES:HEADER_BYTES + h.meta_bytes], frame[HEADER_BYTES + h.meta_bytes:]

    def _run(self, codec: Codec, fn: Any, *args: Any) -> Optional[bool]:
        try:
            return fn(*args)
        except Exception:  # a codec bug or hostile bytes: a miss, never raised into a load
            log.exception("ucm: codec %s failed to decode a block", codec.name)
            return False

    def _decode(self, frame: memoryview, out: memoryview) -> Status:
        opened = self._open(frame, out)
        if opened is None:
            return Status.CORRUPT
        return self._decode_opened(*opened, out)

    def _decode_opened(self, codec: Codec, meta: memoryview, body: memoryview, out: memoryview) -> Status:
        if not self._run(codec, codec.decode, meta, body, out):
            self._count("codec_decode_failures")
            return Status.CORRUPT
        self._count("codec_decoded_blocks")
        return Status.OK

    @contextmanager
    def _frames(self, keys: Sequence[Key], out: list[Status]) -> Iterator[list[tuple[int, memoryview]]]:
        """The stored frames of `keys` read from the medium, for the block's
        duration: (index, frame) of those read, each key's read status in
        `out`. The read begun by `read_ahead` for exactly these keys when it
        found and read them all, else a read now (`_read_frames`)."""
        read = self._take_ahead(keys)
        if read is None:
            read = self._read_frames(keys)
        try:
            for i, st in read.statuses:
                out[i] = st
            yield read.frames
        finally:
            read.close()

    def _read_frames(self, keys: Sequence[Key]) -> "_FrameRead":
        """Reads the frames of `keys` into one warm scratch mapping
        (`ScratchPool`: fresh buffers cost a page fault per 4 KiB of every
        frame), each at a multiple of the medium's read unit and read with
        its padding when the medium has PaddedReads (nvme: O_DIRECT lands it
        there in place, not in its own scratch and a copy)."""
        self._writes.wait_written(keys)  # read as stored: the decoded bytes, never the raw copy of a lossy codec
        idx, sizes = [], []
        for i, k in enumerate(keys):
            n = self.inner.size_of(k)
            if n is not None:
                idx.append(i)
                sizes.append(n)
        read = _FrameRead()
        if not idx:
            return read
        padded = isinstance(self.inner, PaddedReads)
        unit = self.inner.read_unit if padded else 1
        # each frame at a multiple of the unit (the lease is page-aligned)
        spans = [-(-n // unit) * unit for n in sizes]
        stack = ExitStack()
        try:
            whole = stack.enter_context(memoryview(stack.enter_context(self._scratch.lease(sum(spans)))))
            bufs, frames, at = [], [], 0
            for n, span in zip(sizes, spans):
                bufs.append(whole[at:at + span])
                frames.append(bufs[-1][:n])
                at += span
            stack.callback(lambda: [v.release() for v in frames + bufs])
            got = (self.inner.get_padded if padded else self.inner.get)([keys[i] for i in idx], bufs)
            read.statuses = list(zip(idx, got))
            read.frames = [(i, frame) for i, frame, st in zip(idx, frames, got) if st is Status.OK]
            read.stack = stack
            return read
        except BaseException:
            stack.close()
            raise

    # ---- read ahead (ReadAhead) ------------------------------------------------
    def read_ahead(self, keys: Sequence[Key]) -> None:
        """ReadAhead: the frames of `keys` read on the read-ahead thread now,
        for the next `get` / `get_layers` of exactly these keys; a staging
        calls it before the demotions that free its slots (ucm/tiers/stack.py),
        whose copies then overlap the medium's reads."""
        keys = tuple(keys)
        if not keys:
            return
        with self._lock:
            if self._ahead_closed:
                return
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucm-codec-ahead")
            old, self._ahead = self._ahead, (keys, self._ahead_pool.submit(self._read_frames, keys))
        self._count("codec_read_ahead")
        if old is not None:
            self._drop_ahead(old)

    def _take_ahead(self, keys: Sequence[Key]) -> "Optional[_FrameRead]":
        """The read ahead of exactly `keys` when it read every one of them
        (a key not yet in the tier when it began is read again now), waited
        for; None otherwise, and an unused one is dropped."""
        with self._lock:
            pending, self._ahead = self._ahead, None
        if pending is None:
            return None
        if pending[0] != tuple(keys):
            self._drop_ahead(pending)
            return None
        try:
            read = pending[1].result()
        except Exception:  # a fault of the read ahead: read again
            log.debug("codec tier %s: a read ahead failed", self.name, exc_info=True)
            return None
        if len(read.statuses) != len(keys) or any(st is not Status.OK for _, st in read.statuses):
            read.close()
            self._count("codec_read_ahead_dropped")
            return None
        self._count("codec_read_ahead_used")
        return read

    def _drop_ahead(self, pending: tuple) -> None:
        """Gives back an unused read ahead's scratch once its read ends."""
        self._count("codec_read_ahead_dropped")

        def done(fut: Any) -> None:
            if fut.exception() is None:
                fut.result().close()

        pending[1].add_done_callback(done)

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        out: list[Status] = [Status.NOT_FOUND] * len(keys)
        with self._frames(keys, out) as todo:
            if len(todo) > 1:  # the blocks of a batch in parallel: verify and decode release the GIL
                for (i, _), st in zip(todo, self._decode_pool().map(lambda t: self._decode(t[1], views[t[0]]), todo)):
                    out[i] = st
            elif todo:
                i, buf = todo[0]
                out[i] = self._decode(buf, views[i])
        return out

    def get_layers(self, keys: Sequence[Key], dsts: Sequence[Any], layers: int,
                   landed: Callable[[int, int, int], None]) -> list[Status]:
        """`get`, landing each block range of layers by range (streamed
        loads): every frame is read and verified first, then layers
        [first, last) of every block are decoded, one range of
        `layer_ranges(layers)` after another, and `landed(i, first, last)`
        called for block i once that range of dsts[i] holds its decoded
        bytes. A block whose codec cannot decode part of it is decoded whole
        first (`landed(i, 0, layers)`). A block that fails at any point is
        CORRUPT (after what landed before)."""
        if len(keys) != len(dsts):
            raise ArgumentError(f"get_layers: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        out: list[Status] = [Status.NOT_FOUND] * len(keys)
        with self._frames(keys, out) as frames:
            self._land_layers(frames, views, out, layers, landed)
        return out

    def _land_layers(self, frames: list[tuple[int, memoryview]], views: list[memoryview], out: list[Status],
                     layers: int, landed: Callable[[int, int, int], None]) -> None:
        """get_layers' verify and decode passes over frames read."""
        parts: list[tuple[int, Codec, memoryview, memoryview]] = []
        whole: list[tuple[int, Codec, memoryview, memoryview]] = []
        pool = self._decode_pool()
        # verified in parallel: the checksums release the GIL
        for (i, _), opened in zip(frames, pool.map(lambda t: self._open(t[1], views[t[0]]), frames)):
            if opened is None:
                out[i] = Status.CORRUPT
                continue
            codec = opened[0]
            split = layers > 1 and type(codec).decode_layers is not Codec.decode_layers
            (parts if split else whole).append((i, *opened))
        for p, st in zip(whole, pool.map(lambda p: self._decode_opened(*p[1:], views[p[0]]), whole)):
            out[p[0]] = st
            if st is Status.OK:
                landed(p[0], 0, layers)
        for first, last in layer_ranges(layers):
            if not parts:
                break
            got = list(pool.map(lambda p: self._run(p[1], p[1].decode_layers, p[2], p[3], views[p[0]], first,
                                                    last, layers), parts))
            left = []
            for p, ok in zip(parts, got):
                if ok is None and first == 0:  # this block does not split: whole
                    st = self._decode_opened(p[1], p[2], p[3], views[p[0]])
                    out[p[0]] = st
                    if st is Status.OK:
                        landed(p[0], 0, layers)
                elif not ok:
                    self._count("codec_decode_failures")
                    out[p[0]] = Status.CORRUPT
                else:
                    landed(p[0], first, last)
                    left.append(p)
            parts = left
        for i, _, _, _ in parts:
            out[i] = Status.OK
            self._count("codec_decoded_blocks")
            self._count("codec_layer_decoded_blocks")

    def _decode_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._decoders_pool is None:
                self._decoders_pool = ThreadPoolExecutor(max_workers=DECODE_THREADS,
                                                         thread_name_prefix="ucm-codec-decode")
            return self._decoders_pool


class _FrameRead:
    """The frames of one batch read into a scratch lease: (index, status)
    of each key found, (index, frame) of each read; `close` gives the
    lease back (the frames' views first)."""

    __slots__ = ("statuses", "frames", "stack")

    def __init__(self) -> None:
        self.statuses: list[tuple[int, Status]] = []
        self.frames: list[tuple[int, memoryview]] = []
        self.stack: Optional[ExitStack] = None

    def close(self) -> None:
        self.frames = []
        if self.stack is not None:
            self.stack.close()
            self.stack = None
