"""WriteBehind, the codec tier's queue of demoted blocks: first in first
out, bounded, cancellable, reporting what it could not write, and done
with its queue before it closes."""
import threading

import pytest

from ucm.adapters.base import Status
from ucm.codecs import writer as wmod
from ucm.codecs.writer import WriteBehind


class Medium:
    """The callbacks a codec tier gives its queue, recording what they saw;
    `write` waits at a gate once armed and answers `status`."""

    def __init__(self, status=Status.OK):
        self.status = status
        self.written, self.undone, self.failed = [], [], []
        self.gate = threading.Event()
        self.gate.set()
        self.inside = threading.Event()

    def write(self, key, raw, parent):
        self.inside.set()
        self.gate.wait()
        if isinstance(self.status, Exception):
            raise self.status
        self.written.append((key, bytes(raw), parent))
        return self.status

    def undo(self, key, again):
        self.undone.append((key, again))

    def fail(self, key):
        self.failed.append(key)

    def queue(self):
        return WriteBehind("t", self.write, self.undo, self.fail)


def held(key, data):
    """A queue whose writer is inside the write of `key`, held at the gate."""
    m = Medium()
    m.gate.clear()
    w = m.queue()
    w.submit(key, memoryview(data), None)
    assert m.inside.wait(10)
    return m, w


def test_blocks_are_written_in_submit_order_from_a_copy():
    m = Medium()
    w = m.queue()
    src = bytearray(b"abcd")
    assert w.submit(b"k1", memoryview(src), None) and w.submit(b"k2", memoryview(b"efgh"), b"k1")
    src[:] = b"zzzz"  # the caller's buffer is free once submit returned
    assert w.wait_idle(10)
    assert m.written == [(b"k1", b"abcd", None), (b"k2", b"efgh", b"k1")]
    assert w.stats()["codec_pending_blocks"] == 0 and w.waiting([b"k1"]) == [False]
    w.close()


def test_a_waiting_block_answers_its_size_and_a_reader_waits_for_its_write():
    m, w = held(b"k", b"12345")
    assert w.size_of(b"k") == 5 and w.waiting([b"k", b"x"]) == [True, False] and w.size_of(b"x") is None
    reader = threading.Thread(target=w.wait_written, args=([b"k"],))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()
    m.gate.set()
    reader.join(10)
    assert not reader.is_alive() and w.size_of(b"k") is None
    w.close()


def test_a_block_cancelled_before_its_turn_is_never_written():
    m = Medium()
    m.gate.clear()
    w = m.queue()
    w.submit(b"first", memoryview(b"1"), None)
    assert m.inside.wait(10)  # the writer holds `first`; `second` waits in the queue
    w.submit(b"second", memoryview(b"2"), None)
    assert w.cancel(b"second") and not w.cancel(b"never")
    m.gate.set()
    assert w.wait_idle(10)
    assert [k for k, _, _ in m.written] == [b"first"] and not m.undone and not m.failed
    w.close()


@pytest.mark.parametrize("again", [False, True])
def test_a_block_cancelled_during_its_write_is_undone(again):
    """Cancelled while the medium writes it: once written it is undone;
    `again` tells the tier the key was submitted anew meanwhile (its size
    must stay known)."""
    m, w = held(b"k", b"old")
    assert w.cancel(b"k") and w.waiting([b"k"]) == [False]
    if again:
        assert w.submit(b"k", memoryview(b"new"), None)
    m.gate.set()
    assert w.wait_idle(10)
    assert m.undone[0] == (b"k", again) and not m.failed
    assert [raw for _, raw, _ in m.written] == ([b"old", b"new"] if again else [b"old"])
    w.close()


@pytest.mark.parametrize("status", [Status.NO_SPACE, Status.FAILED, OSError("medium gone")])
def test_a_write_that_does_not_end_ok_is_reported_and_the_writer_goes_on(status):
    m = Medium(status)
    w = m.queue()
    w.submit(b"a", memoryview(b"1"), None)
    w.submit(b"b", memoryview(b"2"), None)
    assert w.wait_idle(10)
    assert m.failed == [b"a", b"b"] and not m.undone  # a raising medium did not stop the thread
    w.close()


def test_a_full_queue_makes_the_next_submit_wait_for_room(monkeypatch):
    monkeypatch.setattr(wmod, "WRITE_BEHIND_BYTES", 8)
    m, w = held(b"a", b"12345")
    done = []
    t = threading.Thread(target=lambda: done.append(w.submit(b"b", memoryview(b"67890"), None)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not done  # 5 + 5 bytes > 8
    m.gate.set()
    t.join(10)
    assert done == [True] and w.wait_idle(10) and w.stats()["codec_write_behind_waits"] == 1
    w.close()


def test_close_writes_what_is_queued_then_refuses():
    m = Medium()
    m.gate.clear()
    w = m.queue()
    for k in (b"a", b"b", b"c"):
        w.submit(k, memoryview(k), None)
    closer = threading.Thread(target=w.close)
    closer.start()
    m.gate.set()
    closer.join(10)
    assert not closer.is_alive() and [k for k, _, _ in m.written] == [b"a", b"b", b"c"]
    assert w.submit(b"d", memoryview(b"d"), None) is False  # the tier writes it on its own thread
