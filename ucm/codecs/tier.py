"""CodecAdapter: a tier below DRAM whose blocks are stored encoded.

The cache wraps the adapter of every tier configured with a codec
(`tiers[].codec`) in one of these, so every medium below DRAM (nvme, fs,
redis, mooncake, third-party tiers) gets the same codec handling without
its adapter knowing: a block demoted into the tier is encoded and stored
as a frame (`ucm.codecs.frame`: codec id, raw size, checksums over the
stored bytes); a block staged back is verified and decoded by the codec
its frame names, whatever codec this tier is configured with now. A frame that does not
verify, an unknown codec id, a decode that fails, or a raw size other than
the destination's is CORRUPT: a miss, never bytes handed on.

The codec encodes with the KV layout registered for the block's size
(`ucm.codecs.layout.LayoutBook`, filled by `CacheAPI.register_layout`); a block with no
layout, or of a size two registered layouts share, is stored under the
`none` codec (counted as `codec_fallback`).

Capacity. The placement plans in raw block bytes; this tier offers it
`capacity x codec.nominal_ratio` of them, and the medium below counts
what is stored (encoded bytes): a tier of B bytes holds about ratio x more
blocks. `used_bytes` reports stored bytes scaled the same way.

Write-behind (`ucm.codecs.writer`). `put` copies each block and returns;
the tier's writer thread encodes it and puts the frame into the medium. A
demotion therefore costs its caller one copy, as a raw tier's buffered put
does, and never an encode: the victims a staging evicts from a full DRAM
tier (a reader waits for that staging) are encoded behind it, not before
its reads. (Encoded on the staging's thread, they took 0.10 s of a 0.21 s
int8 hit of 23 SmolLM2 blocks in process, 0.27 s of 0.45 s with
lossless.) A block still waiting is in the tier (`contains`, `size_of`);
a `get` of it waits for its write and then reads the medium, so a reader
always gets the decoded bytes, never the raw ones of a lossy codec at one
moment and the decoded ones at another. A delete of a waiting block
cancels its write. A write the medium refuses (after `_make_room`) or
fails is reported by `drain_dropped`, as an nvme log's failed region
writes are. `flush` waits for the writer, then flushes the medium.

Range reads (`read_range`) read the whole frame, verify and decode it,
and copy the range out: exactly the decoded bytes of that range (for
`lossless`, the original bytes). Verification needs the whole frame,
which is why a range is not read alone. Streamed loads (`get_layers`,
the LayerReads ability) read and verify the frames of a batch once, then
decode the first range of layers of every block, then the next, ...
(LAYER_RANGES ranges at most; int8 and int4 decode a layer range from
their segment table; lossless decodes whole), so that the engine's first
layers can run while later ones are decoded.

Thread-safe: the codecs are; the size table, the order of stored blocks
and the counters share one lock (`_lock`), the write-behind queue has its
own; both are leaves: no codec, no medium and no callback is called under
either.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from ucm.adapters.base import BlockEntry, Key, LayerReads, PaddedReads, Status, StorageAdapter, read_range
from ucm.buffers import byte_view
from ucm.codecs import codec_class_by_id
from ucm.codecs.base import Codec, NoneCodec
from ucm.codecs.frame import HEADER_BYTES, pack, parse_header, verify
from ucm.codecs.layout import LayoutBook
from ucm.codecs.writer import WriteBehind
from ucm.errors import ArgumentError, ConfigError
from ucm.scratch import ScratchPool

log = logging.getLogger(__name__)

# Threads that verify and decode the blocks of one batched read in parallel.
DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))

# Layer ranges a streamed load (`get_layers`) decodes in turn, at most: each
# range is one pass over the batch's blocks. One pass per layer (30 on
# SmolLM2) cost more than it brought on 2 cores: the int8 NVMe-only hit of
# 23 blocks took 0.12-0.17 s to its last layer against 0.07-0.09 s decoding
# whole, and its first layer no sooner (reading and verifying the frames
# come first and dominate; docs/benchmarks.md, "Codecs: streamed loads").
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


class CodecAdapter(LayerReads):
    """Encodes on put, verifies and decodes on get, around `inner`. Declares
    no RangeReads: a range costs a whole-frame read and decode, so range
    readers (`read_range`) read each block once; streamed loads read the
    frames once and land them layer by layer (LayerReads, `get_layers`)."""

    def __init__(self, inner: StorageAdapter, codec: Codec, layouts: LayoutBook) -> None:
        self.inner = inner
        self.codec = codec
        self.layouts = layouts
        self.name = inner.name  # type: ignore[misc]  # the tier keeps its name
        self.shared = inner.shared  # type: ignore[misc]
        self._decoders: dict[int, Codec] = {codec.codec_id: codec}
        self._raw_size: dict[Key, int] = {}
        self._order: OrderedDict[Key, int] = OrderedDict()  # blocks this adapter stored, oldest first
        self._dropped: list[Key] = []  # given way for a new block (`_make_room`) or not written, not yet drained
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._writes = WriteBehind(self.name, self._write_one, self._undo, self._write_failed)
        self._decoders_pool: Optional[ThreadPoolExecutor] = None  # made by the first batched read
        self._scratch = ScratchPool()  # the frames of reads, warm from one read to the next

    # ---- write -------------------------------------------------------------
    def _encode(self, blob: Any) -> bytearray:
        raw = byte_view(blob, writable=False, what="blob")
        codec: Codec = self.codec
        try:
            enc = codec.encode(raw, self.layouts.for_size(len(raw)))
        except Exception:  # a codec bug: this block stored raw, never the batch's demotion failed
            log.exception("ucm: codec %s failed to encode a block of %d bytes", codec.name, len(raw))
            enc = None
        if enc is not None and len(enc.meta) + len(memoryview(enc.body).cast("B")) >= len(raw):
            enc = None  # no smaller than the raw bytes (tiny tiles, data that does not compress): stored raw
        if enc is None:
            codec = self._decoder(0)
            enc = codec.encode(raw, None)
            self._count("codec_fallback")
        frame = pack(codec.codec_id, len(raw), enc.meta, enc.body)
        self._count("codec_raw_bytes_in", len(raw))
        self._count("codec_stored_bytes_out", len(frame))
        return frame

    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        return self.put_with_parents(keys, blobs, [None] * len(keys))

    def put_with_parents(self, keys: Sequence[Key], blobs: Sequence[Any],
                         parents: Sequence[Optional[Key]]) -> list[Status]:
        """Copies each block into the write-behind queue and returns OK for
        it; the writer thread encodes and stores it (`WriteBehind.submit`:
        waits while the queue is full). After `close` began, writes on the
        caller's thread."""
        if not len(keys) == len(blobs) == len(parents):
            raise ArgumentError(f"put: {len(keys)} keys, {len(blobs)} blobs, {len(parents)} parents")
        views = [byte_view(b, writable=False, what="blob") for b in blobs]
        return [Status.OK if self._writes.submit(k, v, parent) else self._write([k], [v], [parent])[0]
                for k, v, parent in zip(keys, views, parents)]

    def _write(self, keys: Sequence[Key], blobs: Sequence[Any], parents: Sequence[Optional[Key]]) -> list[Status]:
        """Encodes and stores the blocks now, on this thread."""
        sizes = [len(byte_view(b, writable=False, what="blob")) for b in blobs]
        frames = [self._encode(b) for b in blobs]
        out = self.inner.put_with_parents(keys, frames, parents)
        if Status.NO_SPACE in out and not self.shared:
            out = self._make_room(keys, frames, parents, out)
        with self._lock:
            for k, n, f, st in zip(keys, sizes, frames, out):
                if st is Status.OK:
                    self._raw_size.setdefault(k, n)
                    self._order[k] = len(f)
        return out

    def _write_one(self, key: Key, raw: bytearray, parent: Optional[Key]) -> Status:
        return self._write([key], [raw], [parent])[0]

    def _undo(self, key: Key, again: bool) -> None:
        """A block deleted while its write was under way was written: deleted again."""
        self.inner.delete([key])
        with self._lock:
            self._order.pop(key, None)
            if not again:
                self._raw_size.pop(key, None)

    def _write_failed(self, key: Key) -> None:
        with self._lock:
            self._raw_size.pop(key, None)
            self._dropped.append(key)
            self._counts["codec_write_failures"] += 1

    def _make_room(self, keys: Sequence[Key], frames: list, parents: Sequence[Optional[Key]],
                   out: list[Status]) -> list[Status]:
        """The placement planned this tier's room at the codec's nominal
        ratio; blocks that encode worse (raw fallbacks, lossless data that
        does not compress) fill the medium first, and a medium with a byte
        budget (redis, mooncake) then refuses every later demotion while the
        placement, seeing room, never evicts: the tier froze with its oldest
        blocks and each newly demoted one was lost. Instead the oldest blocks
        this adapter stored give way (reported by `drain_dropped`, as an
        nvme log's reclaimed blocks are) until the new one fits."""
        out = list(out)
        batch = set(keys)
        for i, st in enumerate(out):
            while st is Status.NO_SPACE:
                with self._lock:
                    victim = next((k for k in self._order if k not in batch), None)
                    if victim is None:
                        break
                    del self._order[victim]
                    self._raw_size.pop(victim, None)
                    self._dropped.append(victim)
                self._count("codec_room_evictions")
                self.inner.delete([victim])
                st = self.inner.put_with_parents([keys[i]], [frames[i]], [parents[i]])[0]
            out[i] = st
        return out

    # ---- read --------------------------------------------------------------
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
        duration: (index, frame) of those read, views of one warm scratch
        mapping (`ScratchPool`: fresh buffers cost a page fault per 4 KiB of
        every frame), each frame at a multiple of the medium's read unit and
        read with its padding when the medium has PaddedReads (nvme: O_DIRECT
        lands it there in place); `out` gets each key's read status."""
        self._writes.wait_written(keys)  # read as stored: the decoded bytes, never the raw copy of a lossy codec
        idx, sizes = [], []
        for i, k in enumerate(keys):
            n = self.inner.size_of(k)
            if n is not None:
                idx.append(i)
                sizes.append(n)
        if not idx:
            yield []
            return
        padded = isinstance(self.inner, PaddedReads)
        unit = self.inner.read_unit if padded else 1
        spans = [-(-n // unit) * unit for n in sizes]  # each frame at a multiple of the unit (the lease is page-aligned)
        with self._scratch.lease(sum(spans)) as scratch, memoryview(scratch) as whole:
            bufs, frames, at = [], [], 0
            for n, span in zip(sizes, spans):
                bufs.append(whole[at:at + span])
                frames.append(bufs[-1][:n])
                at += span
            try:
                # padded: an O_DIRECT medium reads each frame straight into the scratch, not its own and a copy
                got = (self.inner.get_padded if padded else self.inner.get)([keys[i] for i in idx], bufs)
                for i, st in zip(idx, got):
                    out[i] = st
                yield [(i, frame) for i, frame, st in zip(idx, frames, got) if st is Status.OK]
            finally:
                for buf in frames + bufs:
                    buf.release()

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

    def size_of(self, key: Key) -> Optional[int]:
        """The block's raw (decoded) size, from memory or its frame header."""
        n = self._writes.size_of(key)
        if n is None:
            with self._lock:
                n = self._raw_size.get(key)
        if n is not None:
            return n
        stored = self.inner.size_of(key)
        if stored is None:
            return None
        head = bytearray(min(HEADER_BYTES, stored))
        st = read_range(self.inner, [key], [0], [head])[0]
        if st is Status.NOT_FOUND:
            return None
        h = parse_header(head) if st is Status.OK else None
        if h is None or h.stored_bytes != stored:
            return stored  # not a frame of this format: a get answers CORRUPT
        with self._lock:
            self._raw_size[key] = h.raw_bytes
        return h.raw_bytes

    # ---- the rest is the medium's -------------------------------------------
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return [w or c for w, c in zip(self._writes.waiting(keys), self.inner.contains(keys))]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        cancelled = [self._writes.cancel(k) for k in keys]  # first: a write ending now is undone, or popped below
        with self._lock:
            for k in keys:
                self._raw_size.pop(k, None)
                self._order.pop(k, None)
        return [c or d for c, d in zip(cancelled, self.inner.delete(keys))]

    def iter_keys(self) -> Iterator[Key]:
        return self.inner.iter_keys()

    def iter_entries(self) -> Iterator[BlockEntry]:
        for e in self.inner.iter_entries():
            n = self.size_of(e.key)
            if n is not None:
                with self._lock:  # found at open: the oldest, first to give way (`_make_room`)
                    self._order.setdefault(e.key, e.size_bytes)
                yield BlockEntry(e.key, n, e.parent)

    @property
    def capacity_bytes(self) -> int:
        return int(self.inner.capacity_bytes * self.codec.nominal_ratio)

    @property
    def used_bytes(self) -> int:
        return int(self.inner.used_bytes * self.codec.nominal_ratio)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits for the writer thread (what was put before is encoded and in
        the medium), then for the medium's own flush."""
        deadline = time.monotonic() + timeout_s
        if not self._writes.wait_idle(timeout_s):
            return False
        return self.inner.flush(timeout_s=max(0.0, deadline - time.monotonic()))

    def drain_dropped(self) -> list[Key]:
        dropped = self.inner.drain_dropped()
        with self._lock:
            for k in dropped:
                self._raw_size.pop(k, None)
                self._order.pop(k, None)
            mine, self._dropped = self._dropped, []
        return dropped + mine

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
        raw, stored = counts.get("codec_raw_bytes_in", 0), counts.get("codec_stored_bytes_out", 0)
        return {**self.inner.stats(), "codec": self.codec.name, **counts, **self._writes.stats(),
                "codec_ratio": round(raw / stored, 4) if stored else None,
                "stored_bytes": self.inner.used_bytes}

    def close(self) -> None:
        """Lets the writer store what is queued, then closes the medium."""
        self._writes.close()
        if self._decoders_pool is not None:
            self._decoders_pool.shutdown(wait=True)
        self._scratch.close()
        self.inner.close()


def with_codec(adapter: StorageAdapter, codec: str, index: int, layouts: LayoutBook) -> CodecAdapter:
    """Tier `index`'s adapter behind codec `codec` (ConfigError naming
    `tiers.<index>.codec` for an unknown codec or a shared-memory tier,
    whose slots engines read in place)."""
    from ucm.adapters.base import SharedSlots
    from ucm.codecs import load_codec_class

    key = f"tiers.{index}.codec"
    if isinstance(adapter, SharedSlots):
        raise ConfigError(f"{key}: tier {adapter.name!r} hands its slots to engines as they are; a codec applies "
                          f"to tiers without shared slots (nvme, fs, redis, mooncake), got {codec!r}")
    return CodecAdapter(adapter, load_codec_class(codec, key)(), layouts)
