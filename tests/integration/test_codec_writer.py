"""The codec tier's write-behind: a put returns before its block is
encoded and a read of it waits for the decoded bytes; the writer encodes
at a lower priority than its callers; a staging never waits for the
encode of the victims it demotes into a codec tier."""
import os
import sys
import threading

import pytest

from codec_support import LAYOUT, N, DictAdapter, cfg, int8_decoded, kv_blocks
from ucm.adapters.base import Status
from ucm.adapters.faults import FaultyAdapter
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.codecs.layout import LayoutBook
from ucm.codecs.quant import Int8Codec
from ucm.codecs.tier import CodecAdapter
from ucm.codecs.writer import WRITER_NICE


class GatedCodec(Int8Codec):
    """int8 whose encode waits until the test opens its gate: a codec as
    slow as the test wants."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.encoding = threading.Event()

    def encode(self, raw, layout):
        self.encoding.set()
        self.gate.wait()
        return super().encode(raw, layout)


def gated_tier():
    """A codec tier over an in-memory medium whose int8 encode waits at the codec's gate."""
    book = LayoutBook()
    book.register(LAYOUT)
    medium, codec = DictAdapter(), GatedCodec()
    return CodecAdapter(medium, codec, book), medium, codec


def run_in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_put_returns_before_its_block_is_encoded_and_a_read_waits_for_the_decoded_bytes():
    """Demotions are written behind their caller: a put into a codec tier
    returns while the encode has not finished, the block is in the tier at
    once, and a read of it returns the bytes it decodes to (never the raw
    copy waiting for the writer); a block deleted before its write never
    reaches the medium."""
    a, medium, codec = gated_tier()
    keys, data = kv_blocks(3, 14)
    try:
        put, res = run_in_thread(a.put, keys, data)
        put.join(10)
        assert not put.is_alive() and res == [[Status.OK] * 3]  # the encode is still held
        assert codec.encoding.wait(10) and not medium.blobs
        assert a.contains(keys) == [True] * 3 and a.size_of(keys[0]) == LAYOUT.block_bytes
        assert a.delete([keys[2]]) == [True] and a.contains([keys[2]]) == [False]
        outs = [bytearray(LAYOUT.block_bytes) for _ in keys[:2]]
        get, got = run_in_thread(a.get, keys[:2], outs)
        get.join(0.5)
        assert get.is_alive()  # waits for the write, not served from the raw copy
    finally:
        codec.gate.set()
    get.join(10)
    assert got == [[Status.OK] * 2] and [bytes(o) for o in outs] == [int8_decoded(d) for d in data[:2]]
    assert a.flush(30) and set(medium.blobs) == set(keys[:2])  # the deleted block was never written
    assert a.stats()["codec_pending_blocks"] == 0
    a.close()


@pytest.mark.skipif(sys.platform != "linux", reason="a nice value per thread is Linux's")
def test_the_writer_thread_encodes_at_a_lower_priority_than_its_callers():
    """The writer's encodes are behind every caller: its nice value is
    raised to WRITER_NICE while the thread that put the block keeps its own."""
    a, _, codec = gated_tier()
    keys, data = kv_blocks(1, 15)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        assert a.put(keys, data) == [Status.OK]
        assert codec.encoding.wait(10)  # the writer is inside the encode
        assert os.getpriority(os.PRIO_PROCESS, a._writes.thread.native_id) == max(WRITER_NICE, mine)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        codec.gate.set()
    assert a.flush(30)
    a.close()


def test_a_block_deleted_while_it_is_written_leaves_neither_bytes_nor_a_size_behind():
    """The delete lands while the writer encodes the block: the write ends,
    and the tier deletes the frame again and forgets the block's size."""
    a, medium, codec = gated_tier()
    keys, data = kv_blocks(2, 16)
    try:
        assert a.put(keys, data) == [Status.OK] * 2
        assert codec.encoding.wait(10)  # the writer is inside the first block's encode
        assert a.delete(keys[:1]) == [True]
    finally:
        codec.gate.set()
    assert a.flush(30)
    assert set(medium.blobs) == {keys[1]} and a.contains(keys) == [False, True]
    assert a.size_of(keys[0]) is None and a.size_of(keys[1]) == LAYOUT.block_bytes
    assert a.drain_dropped() == []
    a.close()


class RefusingMedium(DictAdapter):
    def put(self, keys, blobs):
        return [Status.FAILED] * len(keys)


def test_a_write_the_medium_fails_is_reported_dropped_and_is_a_miss():
    book = LayoutBook()
    book.register(LAYOUT)
    a = CodecAdapter(RefusingMedium(), Int8Codec(), book)
    keys, data = kv_blocks(2, 17)
    assert a.put(keys, data) == [Status.OK] * 2  # accepted into the queue
    assert a.flush(30)
    assert sorted(a.drain_dropped()) == sorted(keys) and a.stats()["codec_write_failures"] == 2
    assert a.contains(keys) == [False, False] and a.size_of(keys[0]) is None
    assert a.get(keys[:1], [bytearray(LAYOUT.block_bytes)]) == [Status.NOT_FOUND]
    a.close()


class GatedPuts(FaultyAdapter):
    """The NVMe tier's medium, whose puts wait at a gate once armed."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed = False
        self.gate = threading.Event()
        self.held = threading.Event()

    def put_with_parents(self, keys, blobs, parents):
        if self.armed:
            self.held.set()
            self.gate.wait()
        return super().put_with_parents(keys, blobs, parents)


def test_a_staging_does_not_wait_for_the_victims_it_demotes_into_a_codec_tier(nvme_dir):
    """A reader's staging of NVMe-only blocks into a full DRAM tier demotes
    as many DRAM blocks into the int8 tier. Their encode and write run
    behind the staging: with the medium's writes held, the reader still
    gets every staged block, decoded (before, the staging encoded and wrote
    each victim before its own reads: 0.1 s of a 0.2 s int8 hit of 23
    SmolLM2 blocks, 0.27 s of 0.45 s for lossless)."""
    media = {}

    def factory(i, cls, cap, options):
        a = cls(capacity_bytes=cap, config=options)
        if i == 1:
            a = media[1] = GatedPuts(a)
        return a

    keys, data = kv_blocks(N, 13)
    with UnifiedCache(cfg(nvme_dir, "int8"), tier_factory=factory) as c:
        c.register_layout(LAYOUT)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * N
        assert c.flush(30)
        want = {k: int8_decoded(d) for k, d in zip(keys, data)}
        on_nvme = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"][:8]
        assert len(on_nvme) == 8
        medium = media[1]
        medium.armed = True
        try:
            reader, res = run_in_thread(c.acquire, on_nvme)
            reader.join(15)
            assert not reader.is_alive(), "the staging waited for the writes of its victims"
            assert medium.held.wait(10)  # victims were demoted, and their writes are held
            leases = res[0]
            assert all(le is not None for le in leases)
            assert all(bytes(le.view) == want[k] for k, le in zip(on_nvme, leases))
            c.release(leases)
        finally:
            medium.gate.set()
            reader.join(30)
        assert c.flush(30) and c.stats()["tiers"]["nvme"]["adapter"]["codec_pending_blocks"] == 0
