"""One conformance suite for ucm.api.CacheAPI, run over every implementation:
UnifiedCache in-process (with the shared-slot landing tier, and with a
stack without one, where the slot calls go through scratch buffers) and
CacheClient through `ucm serve`."""
import inspect
import signal
import subprocess

import pytest
import yaml

from support import chain, start_service
from ucm.api import CacheAPI, Handle, Outcome
from ucm.cache.unified import UnifiedCache
from ucm.errors import ArgumentError, UcmError

SIZE = 64 * 1024


def tiers(tmp_path, landing_dram=True):
    nvme = {"adapter": "nvme", "capacity": "32MiB",
            "options": {"path": str(tmp_path / "nvme"), "region_size": "512KiB", "io_chunk": "128KiB"}}
    (tmp_path / "nvme").mkdir(exist_ok=True)
    if not landing_dram:
        return {"tiers": [nvme], "landing_tier": "nvme", "policy": {"name": "lru"}}
    return {"tiers": [{"adapter": "dram", "capacity": "2MiB"}, nvme], "landing_tier": "dram",
            "policy": {"name": "lru"}}


@pytest.fixture(params=["cache", "cache-no-slots", "service"])
def api(request, tmp_path):
    """(a CacheAPI implementation, its kind)."""
    kind = request.param
    if kind == "service":
        from ucm.config.schema import load_config
        from ucm.service import CacheClient

        cfg = tiers(tmp_path)
        sock = str(tmp_path / "ucm.sock")
        cfg["service"] = {"socket": sock}
        path = tmp_path / "ucm.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = start_service(str(path), sock)
        client = CacheClient(sock, load_config(str(path)))
        yield client, kind
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        return
    cache = UnifiedCache(tiers(tmp_path, landing_dram=kind == "cache"))
    yield cache, kind
    cache.close()


def copy_in(data):
    """A write_slots fill that copies data[first + i] into slot i."""
    def fill(first, slots, arena):
        view = memoryview(arena)
        for i, s in enumerate(slots):
            if s is not None:
                off, n = s
                view[off:off + n] = data[first + i]
    return fill


def copy_out(sink):
    """A read_slots fill that collects each leased block into sink[first + i]."""
    def fill(first, slots, arena):
        view = memoryview(arena)
        for i, s in enumerate(slots):
            if s is not None:
                off, n = s
                sink[first + i] = bytes(view[off:off + n])
    return fill


def requests(api):
    return api.stats()["requests"]


def test_implements_the_protocol_with_its_exact_signatures(api):
    impl, _ = api
    assert isinstance(impl, CacheAPI)
    for name, member in inspect.getmembers(CacheAPI, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = inspect.signature(member)
        got = inspect.signature(getattr(type(impl), name))
        assert list(got.parameters) == list(want.parameters), name
        for p in want.parameters.values():
            assert got.parameters[p.name].default == p.default, (name, p.name)


def test_store_then_lookup_locate_load(api):
    impl, _ = api
    keys, data = chain(12, 1, size=SIZE)
    h = impl.store(keys[:8], data[:8])
    assert isinstance(h, Handle)
    assert h.wait(30) == [Outcome.DONE] * 8 and h.ok
    assert impl.lookup(keys) == 8
    where = impl.locate(keys)
    assert all(isinstance(w, str) for w in where[:8]) and where[8:] == [None] * 4
    out = [bytearray(SIZE) for _ in keys]
    res = impl.load(keys, out).wait(30)
    assert res == [Outcome.DONE] * 8 + [Outcome.MISSING] * 4
    assert [bytes(o) for o in out[:8]] == data[:8]
    assert bytes(out[8]) == bytes(SIZE)  # a miss leaves its destination alone


def test_store_continues_a_cached_prefix_with_parent(api):
    impl, _ = api
    keys, data = chain(6, 2, size=SIZE)
    assert impl.store(keys[:3], data[:3]).wait(30) == [Outcome.DONE] * 3
    assert impl.store(keys[3:], data[3:], parent=keys[2]).wait(30) == [Outcome.DONE] * 3
    assert impl.lookup(keys) == 6


def test_write_slots_then_read_slots(api):
    impl, _ = api
    keys, data = chain(10, 3, size=SIZE)
    assert impl.write_slots(keys, [SIZE] * 10, copy_in(data)) == [Outcome.DONE] * 10
    assert impl.lookup(keys) == 10
    sink = [None] * 10
    assert impl.read_slots(keys, [SIZE] * 10, copy_out(sink)) == [Outcome.DONE] * 10
    assert sink == data
    # Already cached: DONE without a slot to fill.
    calls = []
    assert impl.write_slots(keys[:2], [SIZE] * 2, lambda f, s, a: calls.append(s)) == [Outcome.DONE] * 2
    assert all(s is None for slots in calls for s in slots)


def test_read_slots_reports_misses_and_size_mismatches(api):
    impl, _ = api
    keys, data = chain(4, 4, size=SIZE)
    other, _ = chain(2, 40, size=SIZE)
    assert impl.store(keys[:2], data[:2]).wait(30) == [Outcome.DONE] * 2
    sink = [None] * 3
    res = impl.read_slots([keys[0], keys[1], other[0]], [SIZE, SIZE // 2, SIZE], copy_out(sink))
    assert res == [Outcome.DONE, Outcome.CORRUPT, Outcome.MISSING]
    assert sink[0] == data[0] and sink[1] is None and sink[2] is None


def test_a_fill_that_raises_stores_nothing_of_its_chunk(api):
    impl, _ = api
    keys, _ = chain(3, 5, size=SIZE)

    def boom(first, slots, arena):
        raise RuntimeError("the engine's copy failed")

    assert impl.write_slots(keys, [SIZE] * 3, boom) == [Outcome.FAILED] * 3
    assert impl.lookup(keys) == 0


def test_a_fill_that_raises_while_reading_is_failed(api):
    impl, _ = api
    keys, data = chain(2, 6, size=SIZE)
    impl.store(keys, data).wait(30)

    def boom(first, slots, arena):
        raise RuntimeError("the engine's copy failed")

    assert impl.read_slots(keys, [SIZE] * 2, boom) == [Outcome.FAILED] * 2
    assert impl.lookup(keys) == 2  # the blocks stay cached


def test_a_begun_request_counts_once_across_its_calls(api):
    impl, _ = api
    keys, data = chain(8, 7, size=SIZE)
    before = requests(impl)
    impl.begin_request("req-1", keys)
    assert requests(impl) == before + 1
    assert impl.write_slots(keys[:4], [SIZE] * 4, copy_in(data), request_id="req-1") == [Outcome.DONE] * 4
    assert impl.write_slots(keys[4:], [SIZE] * 4, copy_in(data[4:]), parent=keys[3],
                            request_id="req-1") == [Outcome.DONE] * 4
    sink = [None] * 8
    assert impl.read_slots(keys, [SIZE] * 8, copy_out(sink), request_id="req-1") == [Outcome.DONE] * 8
    out = [bytearray(SIZE) for _ in keys]
    assert impl.load(keys, out, request_id="req-1").wait(30) == [Outcome.DONE] * 8
    impl.begin_request("req-1", keys)  # a preempted request begun again: the same request
    assert requests(impl) == before + 1
    assert impl.stats()["open_requests"] >= 1
    impl.finish(keys, 5, request_id="req-1")
    # Calls without an id are a request each.
    impl.load(keys, out).wait(30)
    impl.store(keys, data).wait(30)
    assert requests(impl) == before + 3


def test_an_unknown_request_id_is_a_request_of_its_own(api):
    impl, _ = api
    keys, data = chain(2, 8, size=SIZE)
    before = requests(impl)
    impl.store(keys, data, request_id="never-begun").wait(30)
    impl.load(keys, [bytearray(SIZE), bytearray(SIZE)], request_id="never-begun").wait(30)
    assert requests(impl) == before + 1


def test_prefetch_stages_blocks_into_the_landing_tier(api):
    impl, kind = api
    keys, data = chain(40, 9, size=SIZE)  # more than 2 MiB of DRAM: the prefix goes below
    assert impl.store(keys, data).wait(60) == [Outcome.DONE] * 40
    impl.flush()
    landing = "nvme" if kind == "cache-no-slots" else "dram"
    low = [k for k, t in zip(keys, impl.locate(keys)) if t != landing][:4]
    if kind == "cache-no-slots":
        assert low == []  # one tier: nothing lies below the landing tier
        assert impl.prefetch(keys[:4]).wait(30) == [Outcome.DONE] * 4
        return
    assert len(low) == 4
    assert impl.prefetch(low).wait(30) == [Outcome.DONE] * 4
    assert impl.locate(low) == ["dram"] * 4


def test_read_ranges_reads_spans_where_the_blocks_are(api):
    """Ranges of DRAM blocks and of blocks held only below it: exact bytes,
    the serving tier named, and (in process) nothing staged; the service
    stages below-landing blocks whole and says so in the bytes it counts."""
    impl, kind = api
    keys, data = chain(40, 11, size=SIZE)  # more than 2 MiB of DRAM: the prefix goes below
    assert impl.store(keys, data).wait(60) == [Outcome.DONE] * 40
    impl.flush()
    where = impl.locate(keys)
    landing = "nvme" if kind == "cache-no-slots" else "dram"
    picks = [i for i, t in enumerate(where) if t != landing][:2] + [i for i, t in enumerate(where) if t == landing][:2]
    spans = [(5, 100), (SIZE // 2, 4096), (SIZE - 7, 7)]
    dsts = [[bytearray(n) for _, n in spans] for _ in picks]
    got = impl.read_ranges([keys[i] for i in picks], [[o for o, _ in spans]] * len(picks), dsts)
    assert [r.outcome for r in got] == [Outcome.DONE] * len(picks)
    for i, d in zip(picks, dsts):
        assert [bytes(x) for x in d] == [data[i][o:o + n] for o, n in spans]
    ranged = sum(n for _, n in spans)
    for i, r in zip(picks, got):
        assert r.tier == where[i]
        assert r.bytes == (SIZE if kind == "service" and where[i] != landing else ranged)
    if kind != "service":
        assert impl.locate([keys[i] for i in picks]) == [where[i] for i in picks]  # not staged
        s = impl.stats()
        assert s["range_blocks"] == len(picks)
        assert sum(t["range_bytes"] for t in s["tiers"].values()) == ranged * len(picks)


def test_read_ranges_reports_misses_and_ranges_past_the_end(api):
    impl, _ = api
    keys, data = chain(2, 12, size=SIZE)
    impl.store(keys[:1], data[:1]).wait(30)
    got = impl.read_ranges(keys + keys[:1], [[0], [0], [SIZE - 4]], [[bytearray(8)], [bytearray(8)], [bytearray(8)]])
    assert [r.outcome for r in got] == [Outcome.DONE, Outcome.MISSING, Outcome.CORRUPT]
    assert impl.lookup(keys[:1]) == 1  # a range past the end is the caller's, not the block's fault
    assert impl.read_ranges([], [], []) == []


def test_empty_batches(api):
    impl, _ = api
    assert impl.lookup([]) == 0
    assert impl.locate([]) == []
    assert impl.store([], []).wait(1) == []
    assert impl.load([], []).wait(1) == []
    assert impl.prefetch([]).wait(1) == []
    assert impl.write_slots([], [], copy_in([])) == []
    assert impl.read_slots([], [], copy_out([])) == []


def test_pins_finish_stats_flush(api):
    impl, _ = api
    keys, data = chain(3, 10, size=SIZE)
    impl.store(keys, data).wait(30)
    impl.pin(keys)
    impl.unpin(keys)
    impl.finish(keys, 12)
    s = impl.stats()
    assert s["stored_blocks"] >= 3 and "tiers" in s
    assert impl.flush(30) is True


@pytest.mark.parametrize("call", [
    lambda c: c.lookup(b"\0" * 16),  # one key where a sequence belongs
    lambda c: c.locate([b"short"]),
    lambda c: c.store([b"\0" * 16], [b"a", b"b"]),
    lambda c: c.load([b"\0" * 16], [bytearray()]),
    lambda c: c.store([b"\0" * 16], [b""]),  # an empty buffer
    lambda c: c.flush(0),
    lambda c: c.store([b"\0" * 16], [b"a"], parent=b"x"),
    lambda c: c.write_slots([b"\0" * 16], [0], copy_in([b""])),
    lambda c: c.write_slots([b"\0" * 16], [1, 2], copy_in([b""])),
    lambda c: c.read_slots([b"\0" * 16], [True], copy_out([None])),
    lambda c: c.begin_request("", [b"\0" * 16]),
    lambda c: c.begin_request(None, [b"\0" * 16]),
    lambda c: c.store([b"\0" * 16], [b"a"], request_id=7),
    lambda c: c.finish([b"\0" * 16], -1),
    lambda c: c.read_ranges([b"\0" * 16], [[0, 1]], [[bytearray(1)]]),
    lambda c: c.read_ranges([b"\0" * 16], [[-1]], [[bytearray(1)]]),
    lambda c: c.read_ranges([b"\0" * 16], [[0]], [[b"read-only"]]),
    lambda c: c.read_ranges([b"\0" * 16], [], []),
])
def test_misuse_is_an_argument_error(api, call):
    impl, _ = api
    with pytest.raises(ArgumentError):
        call(impl)


def test_use_after_close_is_a_typed_error(api):
    impl, _ = api
    keys, data = chain(1, 11, size=SIZE)
    impl.close()
    with pytest.raises(UcmError):
        impl.store(keys, data)
    with pytest.raises(UcmError):
        impl.write_slots(keys, [SIZE], copy_in(data))
