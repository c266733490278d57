"""Streamed loads (UnifiedCache.stream_slots) over real dram and nvme
tiers: blocks on NVMe only land in DRAM slots layer by layer, each landed
layer holds exactly the stored bytes, a corrupted layer range makes its
block a miss (and forgets it) without holding up the other blocks or the
later layers' waits."""
import os
import threading

from support import chain
from ucm import _native
from ucm.adapters.faults import FaultyAdapter, FaultyDevice
from ucm.adapters.nvme import NvmeAdapter
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache
from ucm.layer_stream import LayerStreams

LAYERS = 8
LAYER = 32 * 1024
SIZE = LAYERS * LAYER


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": "4MiB"},
                      {"adapter": "nvme", "capacity": "32MiB",
                       "options": {"path": nvme_dir, "region_size": "1MiB", "io_chunk": "256KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def on_nvme(nvme_dir, n, seed):
    """n blocks stored and flushed; a fresh cache then holds them on NVMe only."""
    keys, data = chain(n, seed, SIZE)
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * n
        assert c.flush()
        stuff, sdata = chain(16, seed + 50, SIZE)  # push them out of DRAM
        assert c.store(stuff, sdata).wait(30) == [Outcome.DONE] * 16
        assert c.flush()
    return keys, data


def layer_bytes(stream, i, layer):
    off, _ = stream.slots[i]
    return bytes(memoryview(stream.arena)[off + layer * LAYER:off + (layer + 1) * LAYER])


def test_a_stream_from_nvme_lands_every_layer_with_the_stored_bytes(nvme_dir):
    keys, data = on_nvme(nvme_dir, 4, 1)
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert isinstance(c, LayerStreams)
        assert c.locate(keys) == ["nvme"] * 4
        s = c.stream_slots(keys, [SIZE] * 4, LAYERS, request_id="r1")
        try:
            assert all(slot is not None for slot in s.slots)
            for layer in range(LAYERS):
                assert s.wait_layer(layer, 10.0) == [True] * 4
                for i in range(4):
                    assert layer_bytes(s, i, layer) == data[i][layer * LAYER:(layer + 1) * LAYER]
            assert s.outcomes(10.0) == [Outcome.DONE] * 4
        finally:
            s.release()
        assert c.locate(keys) == ["dram"] * 4  # staged: a later request reads DRAM
        assert c.stats()["streamed_blocks"] == 4


def test_a_stream_mixing_dram_and_nvme_blocks_and_a_miss(nvme_dir):
    keys, data = on_nvme(nvme_dir, 3, 2)
    with UnifiedCache(cfg(nvme_dir)) as c:
        got = [bytearray(SIZE)]
        assert c.load(keys[:1], got).wait(30) == [Outcome.DONE]  # promoted: block 0 in DRAM
        assert c.locate(keys)[0] == "dram"
        missing = os.urandom(16)
        s = c.stream_slots(keys + [missing], [SIZE] * 4, LAYERS)
        try:
            assert s.slots[3] is None
            assert s.wait_layer(LAYERS - 1, 10.0) == [True, True, True, False]
            assert s.outcomes(10.0) == [Outcome.DONE, Outcome.DONE, Outcome.DONE, Outcome.MISSING]
            for i in range(3):
                assert b"".join(layer_bytes(s, i, lay) for lay in range(LAYERS)) == data[i]
        finally:
            s.release()


def test_a_corrupted_layer_range_is_a_miss_for_its_block_and_nothing_waits_long(nvme_dir):
    keys, data = on_nvme(nvme_dir, 4, 3)
    path = os.path.join(nvme_dir, "ucm-regions.dat")
    raw = open(path, "rb").read()
    bad_layer = 5
    pos = raw.find(data[2][bad_layer * LAYER:bad_layer * LAYER + 4096]) + 100
    assert pos > 100
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 1]))
    with UnifiedCache(cfg(nvme_dir)) as c:
        s = c.stream_slots(keys, [SIZE] * 4, LAYERS)
        try:
            for layer in range(LAYERS):
                ok = s.wait_layer(layer, 10.0)
                assert s.progress.landed(layer) is not None  # every block settled: the wait did not time out
                assert ok[0] and ok[1]  # block 3 may go too: a child is forgotten with its parent
                if layer >= bad_layer:
                    assert not ok[2]
                for i in range(4):
                    if ok[i]:  # whatever is reported landed is the stored bytes, never others
                        assert layer_bytes(s, i, layer) == data[i][layer * LAYER:(layer + 1) * LAYER]
            assert s.outcomes(10.0)[:3] == [Outcome.DONE, Outcome.DONE, Outcome.MISSING]
        finally:
            s.release()
        assert c.stats()["corrupt"] >= 1
        assert c.lookup(keys) == 2  # the bad block is forgotten (and its descendants with it)


class ReadGate:
    """The nvme tier reads through a device that, once `armed`, holds every
    read at a gate until `open()` (a busy disk made deterministic):
    `entered` is set when a read reaches the gate, `passed` counts the reads
    it let through. `factory` is the cache's tier_factory."""

    # The longest a read is held, so that a test that fails still ends: longer
    # than a stream waits for its slots (30 s), so a stream that waited for
    # the reads to end returns only after some passed.
    HOLD_S = 60.0

    def __init__(self):
        self.armed = False
        self.entered = threading.Event()
        self.passed = 0
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.device = FaultyDevice(_native.IoEngine(2))
        self.device.before = self._before

    def _before(self, op):
        if op != "read" or not self.armed:
            return
        self.entered.set()
        self._open.wait(self.HOLD_S)
        with self._lock:
            self.passed += 1

    def open(self):
        self._open.set()

    def factory(self, index, cls, capacity, options):
        if cls is NvmeAdapter:
            return cls(capacity_bytes=capacity, config=options, device=self.device)
        return cls(capacity_bytes=capacity, config=options)


def test_two_prefetches_of_one_block_report_done_only_once_its_bytes_landed(nvme_dir):
    keys, data = on_nvme(nvme_dir, 6, 4)
    gate = ReadGate()
    with UnifiedCache(cfg(nvme_dir), tier_factory=gate.factory) as c:
        gate.armed = True
        try:
            first = c.prefetch(keys)
            assert gate.entered.wait(10)  # the first staging has planned its copies and is reading
            second = c.prefetch(keys)  # joins the first staging's copies instead of skipping them
            assert gate.passed == 0  # asked while none of the first staging's reads had ended
        finally:
            gate.open()
        assert second.wait(30) == [Outcome.DONE] * 6
        leases = c.acquire(keys)
        try:
            assert all(le is not None for le in leases)
            assert [bytes(le.view) for le in leases] == data
        finally:
            c.release(leases)
        assert first.wait(30) == [Outcome.DONE] * 6


def test_a_tier_without_range_reads_is_streamed_a_whole_block_at_a_time(nvme_dir):
    """FaultyAdapter declares no RangeReads over nvme (as redis and mooncake
    have none): each block is read once, whole, and lands all at once."""
    keys, data = on_nvme(nvme_dir, 3, 5)

    def wrap(index, cls, capacity, options):
        a = cls(capacity_bytes=capacity, config=options)
        return FaultyAdapter(a) if cls is NvmeAdapter else a

    with UnifiedCache(cfg(nvme_dir), tier_factory=wrap) as c:
        s = c.stream_slots(keys, [SIZE] * 3, LAYERS)
        try:
            assert s.wait_layer(LAYERS - 1, 10.0) == [True] * 3
            assert s.outcomes(10.0) == [Outcome.DONE] * 3
            for i in range(3):
                assert b"".join(layer_bytes(s, i, lay) for lay in range(LAYERS)) == data[i]
        finally:
            s.release()
        nvme = c.stats()["tiers"]["nvme"]["adapter"]
        assert nvme.get("range_reads", 0) == 0 and nvme["bytes_read"] == 3 * SIZE  # each block once


def test_a_stream_of_blocks_another_staging_is_copying_returns_its_slots_at_once(nvme_dir):
    """A prefetch is staging the blocks (slow disk) when the stream starts:
    the stream joins that staging; `stream_slots` hands the slots out at
    once (it must not block vLLM's worker thread until the whole staging
    ends) and the blocks land, with the stored bytes, once it has."""
    keys, data = on_nvme(nvme_dir, 3, 6)
    gate = ReadGate()
    with UnifiedCache(cfg(nvme_dir), tier_factory=gate.factory) as c:
        gate.armed = True
        try:
            pre = c.prefetch(keys)
            assert gate.entered.wait(10)  # the prefetch has planned its copies and is reading
            s = c.stream_slots(keys, [SIZE] * 3, LAYERS)
            held = gate.passed == 0
        finally:
            gate.open()
        try:
            assert held  # it returned while the prefetch's reads were all held
            assert all(slot is not None for slot in s.slots)
            assert s.wait_layer(LAYERS - 1, 20.0) == [True] * 3
            assert s.outcomes(20.0) == [Outcome.DONE] * 3
            for i in range(3):
                assert b"".join(layer_bytes(s, i, lay) for lay in range(LAYERS)) == data[i]
        finally:
            s.release()
        assert pre.wait(30) == [Outcome.DONE] * 3
        assert gate.passed > 0  # the blocks came through the held reads


def test_a_third_stream_in_flight_gets_its_slots_without_waiting_for_the_first(nvme_dir):
    """Three requests of one step stream at once (start_load_kv starts them
    one after another): each `stream_slots` returns once its own reads are
    issued, not once an earlier stream's reads all ended."""
    keys, data = on_nvme(nvme_dir, 6, 7)
    gate = ReadGate()
    with UnifiedCache(cfg(nvme_dir), tier_factory=gate.factory) as c:
        gate.armed = True
        streams = []
        try:
            for j in range(3):
                streams.append(c.stream_slots(keys[2 * j:2 * j + 2], [SIZE] * 2, LAYERS))
            held = gate.passed == 0
        finally:
            gate.open()
        try:
            assert held  # all three returned while every read was held: nobody waited for another's
            for j, s in enumerate(streams):
                assert s.wait_layer(LAYERS - 1, 20.0) == [True] * 2
                assert s.outcomes(20.0) == [Outcome.DONE] * 2
                for i in range(2):
                    assert b"".join(layer_bytes(s, i, lay) for lay in range(LAYERS)) == data[2 * j + i]
        finally:
            for s in streams:
                s.release()
        assert gate.passed > 0  # the blocks came through the held reads


def test_a_fault_while_a_stream_starts_is_a_miss_and_leaks_no_lease(nvme_dir):
    """`stream_slots` never raises for a cache fault (LayerStreams): a fault
    after a DRAM block was leased gives that lease back and makes every
    block a miss. Here the DRAM tier (wrapped, ucm.adapters.faults) raises
    while the stream gives back the slot of its second block, which it asked
    for at another size than the block's."""
    keys, data = on_nvme(nvme_dir, 2, 8)

    def faulty_dram(index, cls, capacity, options):
        a = cls(capacity_bytes=capacity, config=options)
        return FaultyAdapter(a) if cls is not NvmeAdapter else a

    with UnifiedCache(cfg(nvme_dir), tier_factory=faulty_dram) as c:
        assert c.load(keys, [bytearray(SIZE) for _ in keys]).wait(30) == [Outcome.DONE] * 2  # both in DRAM
        dram = c.adapters[0]
        dram.raise_on("release", RuntimeError("injected"), times=1)
        s = c.stream_slots(keys, [SIZE, 2 * SIZE], LAYERS)  # block 0 leased, then block 1's slot given back
        try:
            assert s.wait_layer(0, 1.0) == [False, False]
            assert s.outcomes(1.0) == [Outcome.MISSING] * 2
        finally:
            s.release()
        assert dram.calls["release"] >= 2  # the injected fault, then block 0's lease given back
        # No lease left on block 0: deleted, its slot is free at once (a leased one waits for its release).
        used = dram.used_bytes
        assert dram.delete(keys[:1]) == [True]
        assert dram.used_bytes == used - dram.footprint_bytes(SIZE)


def test_a_stream_with_a_missing_block_returns_its_slots_before_the_reads_end(nvme_dir):
    """A block found nowhere (evicted since the lookup) is a miss at once:
    `stream_slots` does not wait for the other blocks' reads to end."""
    keys, data = on_nvme(nvme_dir, 2, 9)
    gate = ReadGate()
    with UnifiedCache(cfg(nvme_dir), tier_factory=gate.factory) as c:
        gate.armed = True
        try:
            s = c.stream_slots(keys + [os.urandom(16)], [SIZE] * 3, LAYERS)
            held = gate.passed == 0
        finally:
            gate.open()
        try:
            assert held  # it returned while the other blocks' reads were held
            assert s.slots[0] is not None and s.slots[1] is not None and s.slots[2] is None
            assert s.wait_layer(LAYERS - 1, 20.0) == [True, True, False]
            assert s.outcomes(20.0) == [Outcome.DONE, Outcome.DONE, Outcome.MISSING]
        finally:
            s.release()
        assert gate.passed > 0  # the blocks came through the held reads
