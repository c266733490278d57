"""read_slots / write_slots cut into pipelined parts (ucm/service/client/slots.py):
the next part's request is sent before this part is copied, and the
outcomes keep their sequential meaning. Against a real `ucm serve`; the
client's sockets come from a `Wire` (its `socket_factory` seam), which
records the requests written and the closes, and injects faults."""
import signal
import socket
import threading

import pytest
import yaml

from ucm import _native
from ucm.api import Outcome
from ucm.errors import UcmError
from ucm.service import CacheClient
from ucm.service import protocol as proto
from ucm.service.client import slots as client_slots
from support import SIZE, chain, start_service, stop_service


class Wire:
    """A CacheClient's `socket_factory`: real Unix stream sockets, each
    wrapped to record the requests written to it (`sent`: op and args, in
    order) and how often it was closed, and to make the next request
    written fail (`fail_next`: EPIPE, as from a dead service) or tear
    (`tear_next`: half the frame goes out, then a KeyboardInterrupt, as
    from a signal handler)."""

    def __init__(self):
        self.sockets = []
        self.sent = []
        self.fail_next = False
        self.tear_next = False

    def __call__(self):
        s = WireSocket(self, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        self.sockets.append(s)
        return s

    def last(self, op):
        """The args of the last `op` request written."""
        return [args for o, args in self.sent if o == op][-1]


class WireSocket:
    def __init__(self, wire, sock):
        self.wire, self.sock, self.closes = wire, sock, 0

    def sendall(self, data):
        decoder = proto.FrameDecoder(len(data))
        decoder.feed(bytes(data))
        _, op, args = decoder.next()
        self.wire.sent.append((op, args))
        if self.wire.fail_next:
            self.wire.fail_next = False
            raise BrokenPipeError(32, "injected")
        if self.wire.tear_next:
            self.wire.tear_next = False
            self.sock.sendall(bytes(data)[:len(data) // 2])
            raise KeyboardInterrupt
        return self.sock.sendall(data)

    def close(self):
        self.closes += 1
        self.sock.close()

    def __getattr__(self, name):
        return getattr(self.sock, name)


@pytest.fixture
def wire():
    return Wire()


@pytest.fixture
def service(tmp_path, monkeypatch, wire):
    monkeypatch.setattr(client_slots, "PART_BYTES", 2 * SIZE)  # two blocks a part
    monkeypatch.setattr(client_slots, "PART_BLOCKS", 1)
    sock = str(tmp_path / "ucm.sock")
    cfg = {"tiers": [{"adapter": "dram", "capacity": "32MiB"}], "policy": {"name": "lru"},
           "service": {"socket": sock}}
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = start_service(path, sock)
    client = CacheClient(sock, socket_factory=wire)
    try:
        yield client
    finally:
        client.close()
        stop_service(proc, signal.SIGKILL)


def writer(data, seen=None, wire=None, fail_at=None):
    """A fill copying data[first + i] into each slot; records, per call,
    `first` and the first key of the last reservation written by then."""
    def fill(first, slots, arena):
        if seen is not None:
            seen.append((first, wire.last("reserve")["keys"][0]))
        if first == fail_at:
            raise RuntimeError("injected copy failure")
        m = memoryview(arena)
        for i, s in enumerate(slots):
            if s is not None:
                _native.copy(m[s[0]:s[0] + s[1]], data[first + i])
    return fill


def reader(out):
    def fill(first, slots, arena):
        m = memoryview(arena)
        for i, s in enumerate(slots):
            if s is not None:
                _native.copy(out[first + i], m[s[0]:s[0] + s[1]])
    return fill


def settled(client):
    """The service's leases and reservations (a stats request also reads
    the replies of releases sent without waiting)."""
    s = client.stats()["service"]
    return s["leases"], s["reserved"]


def test_parts_are_pipelined_and_the_bytes_exact(service, wire):
    keys, data = chain(9, 1)
    seen = []
    assert service.write_slots(keys, [SIZE] * 9, writer(data, seen, wire)) == [Outcome.DONE] * 9
    assert [f for f, _ in seen] == [0, 2, 4, 6, 8]
    # While parts 0-3 were copied, the reservation of the next part was on its way.
    assert [k for _, k in seen] == [keys[2], keys[4], keys[6], keys[8], keys[8]], seen
    out = [bytearray(SIZE) for _ in keys]
    assert service.read_slots(keys, [SIZE] * 9, reader(out)) == [Outcome.DONE] * 9
    assert [bytes(o) for o in out] == data
    assert settled(service) == (0, 0)


def test_large_blocks_go_several_to_a_part(service, wire, monkeypatch):
    """PART_BLOCKS blocks a part where they are more than PART_BYTES: a
    copier's fixed cost per call is shared (ucm bench pages)."""
    monkeypatch.setattr(client_slots, "PART_BLOCKS", 3)
    keys, data = chain(8, 5)
    seen = []
    assert service.write_slots(keys, [SIZE] * 8, writer(data, seen, wire)) == [Outcome.DONE] * 8
    assert [f for f, _ in seen] == [0, 3, 6]
    firsts = []
    out = [bytearray(SIZE) for _ in keys]
    read = reader(out)
    assert service.read_slots(keys, [SIZE] * 8,
                              lambda first, slots, arena: (firsts.append(first), read(first, slots, arena))) \
        == [Outcome.DONE] * 8
    assert firsts == [0, 3, 6] and [bytes(o) for o in out] == data
    assert settled(service) == (0, 0)


def test_a_fill_that_raises_aborts_its_part_and_the_one_reserved_ahead(service):
    keys, data = chain(8, 2)
    got = service.write_slots(keys, [SIZE] * 8, writer(data, fail_at=2))
    assert got == [Outcome.DONE] * 2 + [Outcome.FAILED] * 2 + [Outcome.MISSING] * 4
    assert settled(service) == (0, 0)  # part 2 aborted, part 3 (reserved ahead) too
    assert service.lookup(keys) == 2
    assert service.write_slots(keys, [SIZE] * 8, writer(data)) == [Outcome.DONE] * 8
    assert service.lookup(keys) == 8


def test_a_part_commits_only_after_the_part_before_it_did(service, wire):
    """Part 0's reservations are taken back before its commit (as when the
    service gives them back), so its commit comes back False; part 1,
    already filled, is then aborted, never committed without its parents."""
    keys, data = chain(6, 3)
    copy = writer(data)

    def fill(first, slots, arena):
        copy(first, slots, arena)
        if first == 0:  # over the same connection, before part 0's commit is sent
            service.connection.call("abort", {"keys": keys[:2]})

    got = service.write_slots(keys, [SIZE] * 6, fill)
    assert got == [Outcome.FAILED] * 2 + [Outcome.MISSING] * 4
    # The taking back, part 0's commit, then part 1's abort: part 1 is never committed.
    assert [op for op, _ in wire.sent if op in ("commit", "abort")] == ["abort", "commit", "abort"], wire.sent
    assert wire.last("abort")["keys"] == keys[2:4]
    assert service.lookup(keys) == 0
    assert settled(service) == (0, 0)


def test_a_refused_block_ends_the_call(service):
    keys, data = chain(6, 4)
    assert service.write_slots(keys[:3], [SIZE] * 3, writer(data)) == [Outcome.DONE] * 3
    # keys[3] claims another size than the arena can give (larger than the tier).
    sizes = [SIZE] * 3 + [31 << 20] + [SIZE] * 2
    got = service.write_slots(keys, sizes, writer(data))
    assert got == [Outcome.DONE] * 3 + [Outcome.MISSING] * 3
    assert settled(service) == (0, 0)


def test_loads_of_parts_go_on_past_a_missing_part(service):
    keys, data = chain(6, 5)
    assert service.write_slots(keys, [SIZE] * 6, writer(data)) == [Outcome.DONE] * 6
    other, _ = chain(2, 6)
    ask = keys[:2] + other + keys[4:]
    out = [bytearray(SIZE) for _ in ask]
    got = service.read_slots(ask, [SIZE] * 6, reader(out))
    assert got == [Outcome.DONE] * 2 + [Outcome.MISSING] * 2 + [Outcome.DONE] * 2
    assert [bytes(out[i]) for i in (0, 1, 4, 5)] == [data[i] for i in (0, 1, 4, 5)]
    assert settled(service) == (0, 0)


def test_threads_sharing_a_client_get_their_own_replies(service):
    """Requests of other threads interleave with a call's pipelined ones on
    one connection; every reply reaches its own request."""
    errors = []

    def work(seed):
        try:
            for r in range(6):
                keys, data = chain(7, 100 * seed + r)
                if service.write_slots(keys, [SIZE] * 7, writer(data)) != [Outcome.DONE] * 7:
                    errors.append((seed, r, "store"))
                out = [bytearray(SIZE) for _ in keys]
                if service.read_slots(keys, [SIZE] * 7, reader(out)) != [Outcome.DONE] * 7 or \
                        [bytes(o) for o in out] != data:
                    errors.append((seed, r, "load"))
                if service.lookup(keys) != 7:
                    errors.append((seed, r, "lookup"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((seed, repr(exc)))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert settled(service) == (0, 0)


def retire_by_a_fault(client, wire, keys):
    """A request whose send fails (EPIPE): the client retires its link."""
    wire.fail_next = True
    assert client.locate(keys) == [None] * len(keys)  # the fault is a value


def test_slots_filed_by_another_thread_are_not_used_after_the_link_closed(service, wire):
    """Part 1's acquire is answered while part 0 is copied; another request
    reads that reply (filing it) and then the link is retired (a fault seen
    by a later request). Once part 0's copy ends the socket closes and the
    service gives part 1's leases back: part 1 must not be copied out of
    slots nobody holds (reported DONE), nor the link closed twice."""
    keys, data = chain(4, 7)
    assert service.write_slots(keys, [SIZE] * 4, writer(data)) == [Outcome.DONE] * 4
    calls = []

    def fill(first, slots, arena):
        calls.append(first)
        if first == 0:
            service.stats()  # another request on the link: it files part 1's acquire reply
            retire_by_a_fault(service, wire, keys)
            assert wire.sockets[0].closes == 0  # part 0's copy still runs: the socket stays open
        reader([bytearray(SIZE) for _ in keys])(first, slots, arena)

    got = service.read_slots(keys, [SIZE] * 4, fill)
    assert got[2:] == [Outcome.MISSING] * 2, (got, calls)
    assert calls == [0], calls
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 1  # closed once, when part 0's copy ended


def test_a_reservation_filed_by_another_thread_is_not_filled_after_the_link_closed(service, wire):
    """The store half: part 1's reservation, read by another request and
    then taken back when the retired link's socket closed, is not written
    (its slots may hold another block by then); the link is closed once (a
    second close would unmap the arena kept for a reconnect)."""
    keys, data = chain(6, 8)
    calls = []

    def fill(first, slots, arena):
        calls.append(first)
        if first == 0:
            service.stats()  # files part 1's reserve reply
            retire_by_a_fault(service, wire, keys)
        writer(data)(first, slots, arena)

    got = service.write_slots(keys, [SIZE] * 6, fill)
    assert calls == [0], (calls, got)
    assert got == [Outcome.FAILED] * 2 + [Outcome.MISSING] * 4  # as sequentially: part 0's commit failed
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 1


@pytest.mark.parametrize("op", ["write_slots", "read_slots"])
def test_the_first_call_of_a_client_that_never_connected_is_cut_by_the_arena(service, op):
    """A client made with connect=False learns the arena's size from the
    hello of its first call: that call is cut into parts once the link
    exists (two blocks a part here), not one block a part as for an arena
    of unknown size."""
    keys, data = chain(6, 9)
    if op == "read_slots":
        assert service.write_slots(keys, [SIZE] * 6, writer(data)) == [Outcome.DONE] * 6
    fresh = CacheClient(service.path, connect=False)
    try:
        assert not fresh.connected
        firsts, out = [], [bytearray(SIZE) for _ in keys]
        copy = writer(data) if op == "write_slots" else reader(out)

        def fill(first, slots, arena):
            firsts.append(first)
            copy(first, slots, arena)

        assert getattr(fresh, op)(keys, [SIZE] * 6, fill) == [Outcome.DONE] * 6
        assert firsts == [0, 2, 4], f"parts of the first call start at {firsts}"
        if op == "read_slots":
            assert [bytes(o) for o in out] == data
        assert fresh.lookup(keys) == 6
    finally:
        fresh.close()
    assert settled(service) == (0, 0)


def test_the_first_stream_of_a_client_that_never_connected_is_cut_by_the_arena(service):
    """stream_slots, like read_slots: a client made with connect=False cuts
    its first streamed load by the arena its first hello announces (as a
    connected client does), not one block a chunk."""
    keys, data = chain(6, 11)
    assert service.write_slots(keys, [SIZE] * 6, writer(data)) == [Outcome.DONE] * 6
    fresh = CacheClient(service.path, connect=False)
    try:
        assert not fresh.connected
        connected = service.stream_slots(keys, [SIZE] * 6, 1)
        want = [p.first for p in connected.parts]  # a connected client's chunks
        connected.release()
        stream = fresh.stream_slots(keys, [SIZE] * 6, 1)
        try:
            assert len(want) < 6 and [p.first for p in stream.parts] == want, \
                f"chunks start at {[p.first for p in stream.parts]}, a connected client's at {want}"
            assert stream.outcomes(10) == [Outcome.DONE] * 6
        finally:
            stream.release()
    finally:
        fresh.close()
    assert settled(service) == (0, 0)


@pytest.mark.parametrize("op", ["write_slots", "read_slots"])
def test_an_interrupt_in_a_fill_propagates_and_the_link_counts_no_copy(service, wire, op):
    """A KeyboardInterrupt raised by `fill` (part 1 of 3) reaches the
    caller; the interrupted copy is no longer counted on the link (else its
    socket would stay open once retired, and the service would keep what it
    holds), the slots of that part and of the part asked ahead go back to
    the service, and the client goes on over the same link."""
    keys, data = chain(6, 10)
    if op == "read_slots":
        assert service.write_slots(keys, [SIZE] * 6, writer(data)) == [Outcome.DONE] * 6
    out = [bytearray(SIZE) for _ in keys]
    copy = writer(data) if op == "write_slots" else reader(out)

    def fill(first, slots, arena):
        if first == 2:
            raise KeyboardInterrupt
        copy(first, slots, arena)

    with pytest.raises(KeyboardInterrupt):
        getattr(service, op)(keys, [SIZE] * 6, fill)
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 0  # the same link, not retired
    assert settled(service) == (0, 0)  # part 1's slots and part 2's, asked ahead, given back
    assert service.lookup(keys) == (2 if op == "write_slots" else 6)  # part 0 committed before
    assert getattr(service, op)(keys, [SIZE] * 6, copy) == [Outcome.DONE] * 6
    if op == "read_slots":
        assert [bytes(o) for o in out] == data
    assert service.lookup(keys) == 6 and settled(service) == (0, 0)
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 0
    # No copy is counted on the link any more: retiring it (close) closes its socket at once.
    service.close()
    assert wire.sockets[0].closes == 1


def test_an_interrupt_inside_a_send_retires_the_link_it_tore(service, wire):
    """Half a request frame went out before the interrupt: the link can
    carry no further frame (the service would read the next one from the
    middle of this one), so it is retired and the next call connects again
    at once, with exact bytes."""
    keys, data = chain(4, 20)
    assert service.write_slots(keys, [SIZE] * 4, writer(data)) == [Outcome.DONE] * 4
    wire.tear_next = True
    with pytest.raises(KeyboardInterrupt):
        service.locate(keys)  # a request over the socket (lookup reads the shared index)
    assert wire.sockets[0].closes == 1  # retired: no copy ran on it, so its socket closed
    assert service.locate(keys) == ["dram"] * 4  # no back-off: the service was not at fault
    assert len(wire.sockets) == 2  # over a new link
    out = [bytearray(SIZE) for _ in keys]
    assert service.read_slots(keys, [SIZE] * 4, reader(out)) == [Outcome.DONE] * 4
    assert [bytes(o) for o in out] == data
    assert len(wire.sockets) == 2 and wire.sockets[1].closes == 0
    assert settled(service) == (0, 0)


def test_a_refused_request_keeps_its_link(service, wire):
    keys, data = chain(2, 21)
    with pytest.raises(UcmError, match="refused"):
        service.connection.call("no-such-op", {})
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 0
    assert service.write_slots(keys, [SIZE] * 2, writer(data)) == [Outcome.DONE] * 2
    assert service.locate(keys) == ["dram"] * 2
    assert len(wire.sockets) == 1 and wire.sockets[0].closes == 0  # the same link carried them
