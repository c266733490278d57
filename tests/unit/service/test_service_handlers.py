"""ucm.service.server.handlers over a cache stand-in: every op that may touch an
adapter is declared blocking and runs off the event-loop thread (a stuck
`stats`, `abort`, `lookup` or the abort of a dropped connection does not
stop `hello`); request ids reach the cache, and a bad one is a refusal."""
import socket
import threading
from types import SimpleNamespace

import pytest

from ucm.service import protocol as proto
from ucm.service.server.handlers import OPS, ServiceHandlers
from ucm.service.server.loop import EventLoop

K = [bytes([i]) * 16 for i in range(1, 4)]


class FakeArena:
    segment_path = "/dev/shm/ucm-fake"
    capacity_bytes = 1 << 20

    def slot_offset(self, key):
        return (4096 * key[0], 100)


class StandInCache:
    """Records calls; the ops named in `block` wait on `gate`."""

    def __init__(self, block=()):
        self.block = set(block)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = []
        self.tier_names = ["dram"]
        self.adapters = [SimpleNamespace(shared=False)]

    def _enter(self, name, *args, **kw):
        self.calls.append((name, args, kw))
        if name in self.block:
            self.entered.set()
            assert self.gate.wait(30)

    def lookup(self, keys):
        self._enter("lookup", keys)
        return 0

    def locate(self, keys):
        self._enter("locate", keys)
        return [None] * len(keys)

    def stats(self):
        self._enter("stats")
        return {"tiers": {}}

    def abort(self, keys):
        self._enter("abort", keys)

    def reserve(self, keys, sizes, parent=None, request_id=None, counted=True):
        self._enter("reserve", keys, sizes, parent, request_id=request_id)
        return [memoryview(bytearray(s)) for s in sizes]

    def acquire(self, keys, request_id=None, counted=True):
        self._enter("acquire", keys, request_id=request_id)
        return [SimpleNamespace(offset=8192, length=100) for _ in keys]

    def release(self, leases):
        self._enter("release", len(leases))

    def begin_request(self, request_id, keys, parent=None):
        self._enter("begin_request", request_id, keys, parent)

    def finish(self, keys, output_tokens, request_id=None):
        self._enter("finish", keys, output_tokens, request_id=request_id)

    def unpin(self, keys):
        self._enter("unpin", keys)

    def register_layout(self, layout):
        self._enter("register_layout", layout)


def handlers(cache):
    return ServiceHandlers(cache, FakeArena(), landing_tier="dram", epoch=7, arena_inode=1, block_tokens=16, max_keys=64,
                           prefetch_timeout_s=5, socket="/x.sock")


def test_ops_that_may_touch_an_adapter_are_blocking():
    blocking = {name for name, spec in OPS.items() if spec.blocking}
    # events: the catalog's sweep locates blocks, and a shared tier answers over the network;
    # describe: the catalog's description log (events.path) is a file write
    assert blocking == {"lookup", "locate", "reserve", "abort", "acquire", "prefetch", "stats", "flush", "stream",
                        "events", "describe"}
    # commit publishes filled arena slots in memory; its reclaim runs on the reclaim thread
    assert set(OPS) - blocking == {"hello", "layout", "begin", "commit", "release", "pin", "unpin", "finish",
                                   "stream_release", "holdings"}


@pytest.fixture
def served(tmp_path):
    cache = StandInCache(block={"stats", "abort", "lookup"})
    h = handlers(cache)
    path = str(tmp_path / "h.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    loop = EventLoop(listener, h, workers=4, max_frame_bytes=1 << 16, watchdog_s=30)
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    yield path, cache
    cache.gate.set()
    loop.stop()
    t.join(10)
    loop.close()
    listener.close()


class Wire:
    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.reader = proto.FrameReader(self.sock, 1 << 16)
        self.rid = 0

    def send(self, op, args):
        self.rid += 1
        self.sock.sendall(proto.pack([self.rid, op, args]))
        return self.rid

    def call(self, op, args):
        rid = self.send(op, args)
        reply = self.reader.read()
        assert reply[0] == rid
        return reply

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("op,args", [("stats", {}), ("lookup", {"keys": K}), ("abort", "reserved")])
def test_hello_is_answered_while_an_adapter_op_is_stuck(served, op, args):
    path, cache = served
    a = Wire(path)
    if args == "reserved":
        assert a.call("reserve", {"keys": K[:1], "sizes": [100], "parent": None})[1]
        args = {"keys": K[:1]}
    a.send(op, args)
    assert cache.entered.wait(10)
    b = Wire(path)
    reply = b.call("hello", {"version": proto.VERSION})
    assert reply[1] and reply[2]["epoch"] == 7
    assert b.call("finish", {"keys": K, "output_tokens": 3, "request_id": None})[1]
    cache.gate.set()
    assert a.reader.read()[1]
    a.close()
    b.close()


def test_the_abort_of_a_dropped_connection_does_not_stop_the_loop(served):
    path, cache = served
    a = Wire(path)
    assert a.call("reserve", {"keys": K[:2], "sizes": [100, 100], "parent": None})[1]
    a.close()  # the service aborts its two reservations
    assert cache.entered.wait(10)
    b = Wire(path)
    assert b.call("hello", {"version": proto.VERSION})[1]
    cache.gate.set()
    b.close()
    aborts = [set(args[0]) for name, args, _ in cache.calls if name == "abort"]
    assert aborts == [set(K[:2])]


def test_request_ids_reach_the_cache():
    cache = StandInCache()
    h = handlers(cache)
    conn = h.connect(1)

    def reply(op, args):
        dec = proto.FrameDecoder(1 << 20)
        dec.feed(h.handle(conn, 9, op, args))
        return dec.next()

    assert reply("begin", {"request_id": "r1", "keys": K, "parent": None}) == [9, True, None]
    assert reply("reserve", {"keys": K[:1], "sizes": [100], "parent": None, "request_id": "r1"})[1]
    r = reply("acquire", {"keys": K[:1], "request_id": "r1"})
    assert r[1] and r[2] == {"epoch": 7, "slots": [[1, 8192, 100]]}
    assert reply("finish", {"keys": K, "output_tokens": 4, "request_id": "r1"})[1]
    assert reply("acquire", {"keys": K[:1]})[1]  # no request id: one request of its own
    assert cache.calls[:4] == [
        ("begin_request", ("r1", K, None), {}),
        ("reserve", (K[:1], [100], None), {"request_id": "r1"}),
        ("acquire", (K[:1],), {"request_id": "r1"}),
        ("finish", (K, 4), {"request_id": "r1"}),
    ]
    assert cache.calls[4] == ("acquire", (K[:1],), {"request_id": None})


@pytest.mark.parametrize("op,args", [
    ("begin", {"request_id": "", "keys": K}),
    ("begin", {"request_id": None, "keys": K}),
    ("begin", {"keys": K}),
    ("reserve", {"keys": K[:1], "sizes": [100], "request_id": 5}),
    ("acquire", {"keys": K[:1], "request_id": "x" * 257}),
    ("finish", {"keys": K, "output_tokens": 1, "request_id": b"r1"}),
    ("begin", {"request_id": "r", "keys": K, "parent": b"short"}),
])
def test_a_bad_request_id_from_the_wire_is_a_refusal(op, args):
    cache = StandInCache()
    h = handlers(cache)
    dec = proto.FrameDecoder(1 << 20)
    dec.feed(h.handle(h.connect(1), 3, op, args))
    rid, ok, msg = dec.next()
    assert (rid, ok) == (3, False) and "internal error" not in msg
    assert ("request_id" in msg or "parent" in msg), msg
    assert cache.calls == []


def test_an_unpin_naming_a_key_twice_releases_only_this_connections_pins():
    """Connections A and B each pin k once; A's `unpin [k, k]` gives back its
    one pin, never B's (the cache's pin count is shared)."""
    cache = StandInCache()
    cache.pin = lambda keys: cache.calls.append(("pin", (list(keys),), {}))
    h = handlers(cache)
    a, b = h.connect(1), h.connect(2)

    def reply(conn, op, args):
        dec = proto.FrameDecoder(1 << 20)
        dec.feed(h.handle(conn, 5, op, args))
        return dec.next()

    assert reply(a, "pin", {"keys": [K[0]]})[1] and reply(b, "pin", {"keys": [K[0]]})[1]
    assert reply(a, "unpin", {"keys": [K[0], K[0], K[1]]})[1]
    assert [c for c in cache.calls if c[0] == "unpin"] == [("unpin", ([K[0]],), {})]
    assert reply(a, "unpin", {"keys": [K[0]]})[1]  # nothing left to give back
    assert [c for c in cache.calls if c[0] == "unpin"][-1] == ("unpin", ([],), {})


def test_layout_registers_a_kv_layout_and_refuses_other_bytes(served):
    from ucm.codecs.layout import planar_layout

    path, cache = served
    w = Wire(path)
    try:
        lay = planar_layout("bfloat16", 2, 1, 32, 64)
        ok = w.call("layout", {"layout": lay.to_bytes()})
        assert ok[1] is True
        bad = w.call("layout", {"layout": b"ucmkv\x09nonsense"})
        assert bad[1] is False and "layout" in str(bad[2])
        assert w.call("layout", {"layout": "text"})[1] is False
    finally:
        w.close()
    assert [c for c in cache.calls if c[0] == "register_layout"] == [("register_layout", (lay,), {})]
