"""A staging from a codec tier reads ahead (ReadAhead, ucm/tiers/stack.py
`_read_ahead`): the frames of the blocks it stages are read from the
medium while the demotions that free their DRAM slots still run, and the
blocks come back decoded exactly as without it. A read ahead that is not
used (other keys read, a key not in the tier yet, a failing medium)
changes no result."""
import threading

from codec_support import LAYOUT, N, DictAdapter, cfg, int8_decoded, kv_blocks
from ucm.adapters.base import Status
from ucm.adapters.faults import FaultyAdapter, FaultySharedSlots
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.codecs.layout import LayoutBook
from ucm.codecs.quant import Int8Codec
from ucm.codecs.tier import CodecAdapter


class ReadsBegun(FaultyAdapter):
    """The NVMe tier's medium: sets `began` when a read of it starts."""

    def __init__(self, inner):
        super().__init__(inner)
        self.began = threading.Event()

    def get(self, keys, dsts):
        self.began.set()
        return super().get(keys, dsts)


class DropsWait(FaultySharedSlots):
    """The DRAM tier: once armed, each delete (a demoted victim leaving it)
    waits up to 5 s for the medium's read to begin, and records whether it had."""

    def __init__(self, inner):
        super().__init__(inner)
        self.medium = None
        self.armed = False
        self.seen: list[bool] = []

    def delete(self, keys):
        if self.armed:
            self.seen.append(self.medium.began.wait(5))
        return super().delete(keys)


def test_a_staging_reads_its_frames_while_its_victims_are_demoted(nvme_dir):
    tiers = {}

    def factory(i, cls, cap, options):
        a = cls(capacity_bytes=cap, config=options)
        a = tiers[i] = (DropsWait if i == 0 else ReadsBegun)(a)
        return a

    keys, data = kv_blocks(N, 17)
    with UnifiedCache(cfg(nvme_dir, "int8"), tier_factory=factory) as c:
        c.register_layout(LAYOUT)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * N
        assert c.flush(30)
        want = {k: int8_decoded(d) for k, d in zip(keys, data)}
        on_nvme = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"][:6]
        assert len(on_nvme) == 6
        dram, medium = tiers[0], tiers[1]
        dram.medium = medium
        medium.began.clear()
        dram.armed = True
        leases = c.acquire(on_nvme)
        dram.armed = False
        assert dram.seen and all(dram.seen), dram.seen  # the medium was read before the first victim left
        assert all(le is not None for le in leases)
        assert [bytes(le.view) for le in leases] == [want[k] for k in on_nvme]
        c.release(leases)
        s = c.stats()["tiers"]["nvme"]["adapter"]
        assert s["codec_read_ahead"] >= 1 and s["codec_read_ahead_used"] >= 1


def codec_tier():
    book = LayoutBook()
    book.register(LAYOUT)
    return CodecAdapter(DictAdapter(), Int8Codec(), book)


def test_an_unused_or_partial_read_ahead_changes_no_result():
    keys, data = kv_blocks(4, 23)
    with codec_tier() as a:
        assert a.put(keys[:3], data[:3]) == [Status.OK] * 3 and a.flush(30)
        want = [int8_decoded(d) for d in data]
        out = [bytearray(LAYOUT.block_bytes) for _ in keys]
        # Read ahead of other keys, then a get: the read ahead is dropped, the get reads.
        a.read_ahead(keys[:2])
        assert a.get(keys[1:3], out[1:3]) == [Status.OK] * 2 and [bytes(o) for o in out[1:3]] == want[1:3]
        # A read ahead that found one key missing: the get reads again, and finds it stored since.
        a.read_ahead(keys[2:])
        a._ahead[1].result(10)  # it has read (keys[3] not there) before keys[3] is stored
        assert a.put(keys[3:], data[3:]) == [Status.OK] and a.flush(30)
        assert a.get(keys[2:], out[2:]) == [Status.OK] * 2 and [bytes(o) for o in out[2:]] == want[2:]
        # Used: the same keys in the same order.
        a.read_ahead(keys[:2])
        landed = []
        assert a.get_layers(keys[:2], out[:2], 2, lambda i, f, t: landed.append((i, f, t))) == [Status.OK] * 2
        assert [bytes(o) for o in out[:2]] == want[:2]
        assert sorted(landed) == [(0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2)]
        s = a.stats()
        assert (s["codec_read_ahead"], s["codec_read_ahead_used"], s["codec_read_ahead_dropped"]) == (3, 1, 2)
        a.read_ahead(keys)  # left unused
        pending = a._ahead
    # closing waits for it and gives its scratch back
    assert pending[1].done() and pending[1].result().stack is None


def test_a_read_ahead_of_a_failing_medium_is_a_fault_of_its_get_only():
    keys, data = kv_blocks(2, 29)
    book = LayoutBook()
    book.register(LAYOUT)
    medium = FaultyAdapter(DictAdapter())
    with CodecAdapter(medium, Int8Codec(), book) as a:
        assert a.put(keys, data) == [Status.OK] * 2 and a.flush(30)
        medium.fail("get", Status.FAILED, times=1)
        a.read_ahead(keys)  # its read fails: the get reads again
        out = [bytearray(LAYOUT.block_bytes) for _ in keys]
        assert a.get(keys, out) == [Status.OK] * 2
        assert [bytes(o) for o in out] == [int8_decoded(d) for d in data]
        medium.raise_on("get", OSError("medium gone"), times=1)
        a.read_ahead(keys)  # its read raises in the read-ahead thread: the get reads again
        assert a.get(keys, out) == [Status.OK] * 2
