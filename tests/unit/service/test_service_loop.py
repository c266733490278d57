"""ucm.service.server.loop with a fake handler: a blocking op runs on a worker and
the loop keeps answering everything else meanwhile; replies keep the order
of one connection's requests; a dropped connection's give-back runs on a
worker, not on the loop thread."""
import socket
import threading

import pytest

from ucm.service import protocol as proto
from ucm.service.server.loop import EventLoop


class FakeHandler:
    """`ping` answers at once; `stuck` waits for `release` (a request that
    waits on an adapter); `disconnect` records its thread and may wait too."""

    def __init__(self):
        self.release = threading.Event()
        self.stuck_started = threading.Event()
        self.disconnected = threading.Event()
        self.hold_disconnect = threading.Event()
        self.hold_disconnect.set()
        self.threads = {}

    def connect(self, cid):
        return {"id": cid}

    def blocking(self, op):
        return op == "stuck"

    def handle(self, state, rid, op, args):
        self.threads.setdefault(op, threading.get_ident())
        if op == "stuck":
            self.stuck_started.set()
            if not self.release.wait(30):
                return proto.pack([rid, False, "never released"])
        if op not in ("ping", "stuck"):
            return proto.pack([rid, False, f"unknown op {op!r}"])
        return proto.pack([rid, True, [op, state["id"]]])

    def disconnect(self, state):
        self.threads["disconnect"] = threading.get_ident()
        self.hold_disconnect.wait(30)
        self.disconnected.set()


@pytest.fixture
def served(tmp_path):
    handler = FakeHandler()
    path = str(tmp_path / "loop.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    loop = EventLoop(listener, handler, workers=2, max_frame_bytes=1 << 16, watchdog_s=30)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    yield path, handler, loop, thread
    handler.release.set()
    handler.hold_disconnect.set()
    loop.stop()
    thread.join(10)
    loop.close()
    listener.close()


def client(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    return s, proto.FrameReader(s, 1 << 16)


def call(sock, reader, rid, op):
    sock.sendall(proto.pack([rid, op, {}]))
    return reader.read()


def test_the_loop_answers_while_a_blocking_op_is_stuck(served):
    path, handler, loop, thread = served
    a, ra = client(path)
    a.sendall(proto.pack([1, "stuck", {}]))
    assert handler.stuck_started.wait(10)
    b, rb = client(path)
    for rid in range(2, 12):  # another connection is answered, over and over
        assert call(b, rb, rid, "ping") == [rid, True, ["ping", 2]]
    assert handler.threads["stuck"] != thread.ident and handler.threads["ping"] == thread.ident
    handler.release.set()
    assert ra.read() == [1, True, ["stuck", 1]]
    a.close()
    b.close()


def test_one_connection_keeps_the_order_of_its_requests(served):
    path, handler, loop, thread = served
    a, ra = client(path)
    # A ping queued behind a stuck request of the same connection waits for it.
    a.sendall(proto.pack([1, "stuck", {}]) + proto.pack([2, "ping", {}]))
    assert handler.stuck_started.wait(10)
    a.settimeout(0.3)
    with pytest.raises(socket.timeout):
        ra.read()
    a.settimeout(10)
    handler.release.set()
    assert ra.read() == [1, True, ["stuck", 1]]
    assert ra.read() == [2, True, ["ping", 1]]
    a.close()


def test_a_dropped_connection_is_given_back_on_a_worker(served):
    path, handler, loop, thread = served
    handler.hold_disconnect.clear()
    a, ra = client(path)
    assert call(a, ra, 1, "ping")[1]
    a.close()
    b, rb = client(path)  # the loop answers while the give-back waits
    assert call(b, rb, 2, "ping") == [2, True, ["ping", 2]]
    handler.hold_disconnect.set()
    assert handler.disconnected.wait(10)
    assert handler.threads["disconnect"] != thread.ident
    b.close()


def test_bad_frames_are_refused_and_the_loop_lives_on(served):
    path, handler, loop, thread = served
    a, ra = client(path)
    a.sendall(proto.pack(["not", "a", "request", 4]))
    assert ra.read() == [0, False, "request must be [id:int, op:str, args:map]"]
    assert call(a, ra, 3, "nope") == [3, False, "unknown op 'nope'"]
    a.sendall(b"\xff\xff\xff\xff")  # an oversized frame: the connection is closed
    assert ra.read()[1] is False and ra.read() is None
    b, rb = client(path)
    assert call(b, rb, 4, "ping")[1]
    b.close()
