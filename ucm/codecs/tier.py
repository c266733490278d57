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
its reads (encoded on the staging's thread, they would take a large
share of the hit). A block still waiting is in the tier (`contains`, `size_of`);
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
layers can run while later ones are decoded. A staging's reads begin
before the demotions that free its slots (`read_ahead`, ReadAhead). The
read path is ucm/codecs/reads.py.

Thread-safe: the codecs are; the size table, the order of stored blocks
and the counters share one lock (`_lock`), the write-behind queue has its
own; both are leaves: no codec, no medium and no callback is called under
either.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence

from ucm.adapters.base import BlockEntry, Key, LayerReads, ReadAhead, Status, StorageAdapter, read_range
from ucm.buffers import byte_view
from ucm.codecs.base import Codec
from ucm.codecs.frame import HEADER_BYTES, pack, parse_header
from ucm.codecs.layout import LayoutBook
from ucm.codecs.reads import CodecReads
from ucm.codecs.writer import WriteBehind
from ucm.errors import ArgumentError, ConfigError
from ucm.adapters.scratch import ScratchPool

log = logging.getLogger(__name__)


class CodecAdapter(CodecReads, LayerReads, ReadAhead):
    """Encodes on put, verifies and decodes on get, around `inner`. Declares
    no RangeReads: a range costs a whole-frame read and decode, so range
    readers (`read_range`) read each block once; streamed loads read the
    frames once and land them layer by layer (LayerReads, `get_layers`);
    a staging reads ahead (ReadAhead, `read_ahead`)."""

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
        self._ahead: Optional[tuple] = None  # (keys, future of a _FrameRead): the read ahead not yet used
        self._ahead_pool: Optional[ThreadPoolExecutor] = None  # its one thread, made by the first read_ahead
        self._ahead_closed = False

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
        with self._lock:
            self._ahead_closed = True
            pending, self._ahead = self._ahead, None
        if pending is not None:
            self._drop_ahead(pending)
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True)  # an unused read ahead's scratch is given back as it ends
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
