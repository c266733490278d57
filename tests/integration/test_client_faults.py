"""CacheClient at the process boundary: reconnects that fail half-way, copies
in flight when a connection dies, and replies for another arena. A cache
fault is a miss, never an exception into the engine and never other bytes
reported as a hit (review 0a4baf9, item 1)."""
import os
import signal
import socket
import threading
import time

import pytest
import yaml

from ucm import _native
from ucm.api import Outcome
from ucm.config.schema import UcmConfig
from ucm.service import CacheClient
from ucm.service import protocol as proto
from support import SIZE, chain, start_service, stop_service



def write_config(tmp_path, tiers):
    sock = str(tmp_path / "ucm.sock")
    cfg = {"tiers": tiers, "policy": {"name": "lru"}, "service": {"socket": sock}}
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), sock


def stop(proc):
    stop_service(proc, signal.SIGKILL)


def client_config(timeout_s=30.0):
    return UcmConfig.model_validate({"service": {"request_timeout_s": timeout_s}})


def wait_until(cond, timeout_s=10.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_reconnect_whose_arena_cannot_be_mapped_is_a_miss_and_never_stale(tmp_path):
    """The service restarts; the client's first reconnect cannot open the new
    arena (EMFILE, ENOMEM or a private /dev/shm would do the same). That is a
    miss, not an exception; and no later store may go into the old arena
    while the new service commits the slot (another engine would load zeros
    reported as DONE)."""
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "4MiB"}])
    proc = start_service(cfg_path, sock)
    client = CacheClient(sock, retry_s=0.05)
    try:
        k1, d1 = chain(4, 1)
        assert client.store(k1, d1).wait(30) == [Outcome.DONE] * 4
        stop(proc)
        proc = start_service(cfg_path, sock)
        with CacheClient(sock) as probe:
            arena = probe.service_info["arena_path"]
        hidden = arena + ".hidden"
        os.rename(arena, hidden)  # the next reconnect's open() fails
        try:
            for _ in range(8):  # several reconnect attempts (retry_s apart), each a plain miss
                assert client.lookup(k1) == 0
                time.sleep(0.06)
            assert not client.connected  # nothing half-built was published
        finally:
            os.rename(hidden, arena)
        k2, d2 = chain(3, 2)
        assert wait_until(lambda: client.store(k2, d2).wait(30) == [Outcome.DONE] * 3, 5)
        with CacheClient(sock) as other:
            out = [bytearray(SIZE) for _ in k2]
            assert other.load(k2, out).wait(30) == [Outcome.DONE] * 3
            assert [bytes(o) for o in out] == d2
    finally:
        client.close()
        stop(proc)


def test_a_connection_that_dies_mid_copy_keeps_its_slots_until_the_copy_ends(tmp_path):
    """A request times out (the service hangs for a while) while another
    thread of the same client copies out of a leased slot. The service must
    not hand that slot to anyone else before the copy ends, or the reader
    reports DONE with another block's bytes."""
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "256KiB"}])  # 4 slots
    proc = start_service(cfg_path, sock)
    reader = CacheClient(sock, client_config(timeout_s=0.5), retry_s=0.05)
    writer = CacheClient(sock)
    try:
        k1, d1 = chain(1, 7)
        assert writer.store(k1, d1).wait(30) == [Outcome.DONE]
        in_fill, go = threading.Event(), threading.Event()
        got = bytearray(SIZE)
        result = []

        def fill(first, slots, arena):
            in_fill.set()
            go.wait(30)
            off, length = slots[0]
            _native.copy(got, memoryview(arena)[off:off + length])

        t = threading.Thread(target=lambda: result.append(reader.read_slots(k1, [SIZE], fill)))
        t.start()
        assert in_fill.wait(30)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert reader.stats() == {"available": False}  # timed out: the connection is given up
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # Give the service the time to notice a closed connection (it must not
        # see one while the copy runs; then the lease stays).
        wait_until(lambda: writer.stats()["service"]["leases"] == 0, 2)
        k2, d2 = chain(8, 8)  # twice the arena: every free slot is reused, k1 is evicted
        writer.store(k2, d2).wait(30)
        go.set()
        t.join(30)
        assert result == [[Outcome.DONE]] and bytes(got) == d1[0]
        # Once the copy ended, the retired connection closed and gave its lease back.
        assert wait_until(lambda: writer.stats()["service"]["leases"] == 0)
    finally:
        go.set()
        reader.close()
        writer.close()
        stop(proc)


class _FakeService:
    """A socket that answers hello with a real arena file and acquire/reserve
    with whatever the test sets: the client's checks on slots, on their own."""

    def __init__(self, tmp_path, acquire, reserve):
        self.path = str(tmp_path / "fake.sock")
        self.arena = str(tmp_path / "arena")
        with open(self.arena, "wb") as f:
            f.truncate(1 << 20)
        self.replies = {"acquire": acquire, "reserve": reserve}
        self.ops = []
        self._srv = socket.socket(socket.AF_UNIX)
        self._srv.bind(self.path)
        self._srv.listen(4)
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        reader = proto.FrameReader(conn, 1 << 20)
        while True:
            try:
                frame = reader.read()
            except OSError:
                return
            if frame is None:
                return
            rid, op, args = frame
            self.ops.append(op)
            if op == "hello":
                res = {"version": proto.VERSION, "epoch": 11, "arena_path": self.arena,
                       "arena_bytes": 1 << 20, "arena_inode": os.stat(self.arena).st_ino,
                       "index_path": None, "index_bytes": 0, "shared_tiers": False}
            else:
                res = self.replies.get(op)
            conn.sendall(proto.pack([rid, True, res]))

    def close(self):
        self._srv.close()


@pytest.mark.parametrize("acquire", [
    {"epoch": 12, "slots": [[1, 0, SIZE]]},  # another instance's slot
    {"epoch": 11, "slots": [[1, (1 << 20) - 4096, SIZE]]},  # past the arena's end
    {"epoch": 11, "slots": [[1, -4096, SIZE]]},
    [[1, 0, SIZE]],  # the reply of an older protocol
])
def test_slots_for_another_arena_are_never_filled(tmp_path, acquire):
    fake = _FakeService(tmp_path, acquire=acquire, reserve={"epoch": 12, "slots": [[0, SIZE]]})
    client = CacheClient(fake.path)
    try:
        assert client.connected
        called = []
        k, d = chain(1, 3)
        assert client.read_slots(k, [SIZE], lambda *a: called.append(a)) == [Outcome.MISSING]
        assert called == [] and not client.connected  # that connection is not trusted again
        assert client.store(k, d).wait(10) == [Outcome.FAILED]
        assert "commit" not in fake.ops
    finally:
        client.close()
        fake.close()


def test_a_failing_socket_is_a_value_never_an_exception(tmp_path):
    """The socket seam: a send that fails (EPIPE) mid-request is a miss, and
    the client reconnects on a later call."""
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "4MiB"}])
    proc = start_service(cfg_path, sock)
    armed = []

    class Flaky(socket.socket):
        def sendall(self, data, *args):
            if armed:
                armed.pop()
                raise BrokenPipeError(32, "injected")
            return super().sendall(data, *args)

    client = CacheClient(sock, retry_s=0.0, use_index=False,
                         socket_factory=lambda: Flaky(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        k, d = chain(2, 4)
        assert client.store(k, d).wait(10) == [Outcome.DONE] * 2
        armed.append(1)
        assert client.lookup(k) == 0 and not client.connected
        assert client.lookup(k) == 2 and client.connected
        armed.append(1)
        out = [bytearray(SIZE) for _ in k]
        assert client.load(k, out).wait(10) == [Outcome.MISSING] * 2
        assert client.load(k, out).wait(10) == [Outcome.DONE] * 2 and [bytes(o) for o in out] == d
    finally:
        client.close()
        stop(proc)


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("VmRSS")))


def test_a_client_that_stops_reading_cannot_grow_the_service(tmp_path):
    """Requests keep coming on a connection that never reads its replies: the
    service stops reading it once its unsent replies pass a bound (its memory
    does not grow with them), and goes on serving others."""
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "4MiB"}])
    proc = start_service(cfg_path, sock)
    try:
        with CacheClient(sock) as other:
            k, d = chain(2, 9)
            assert other.store(k, d).wait(10) == [Outcome.DONE] * 2
            reply = len(proto.pack([1, True, other.stats()]))
            before = _rss_kib(proc.pid)
            greedy = socket.socket(socket.AF_UNIX)
            greedy.connect(sock)
            greedy.settimeout(0.5)
            frame = proto.pack([1, "stats", {}])
            n = (32 << 20) // reply  # 32 MiB of replies if the service kept taking requests
            sent = 0
            try:
                for _ in range(n):
                    greedy.sendall(frame)
                    sent += 1
            except TimeoutError:
                pass  # the service stopped reading this connection
            # The loop answers one request at a time: once this reply is here,
            # it has handled whatever it read from the greedy connection.
            assert other.lookup(k) == 2 and other.stats()["service"]["connections"] == 2
            grown = _rss_kib(proc.pid) - before
            assert grown < 8 << 10, (sent, n, grown)  # KiB
            greedy.close()
            assert other.store(*chain(2, 10)).wait(10) == [Outcome.DONE] * 2
        assert proc.poll() is None
    finally:
        stop(proc)


def test_the_first_call_after_a_service_restart_reaches_the_new_service(tmp_path):
    """The service is killed and a new one takes its socket: a client that
    has not used its connection since sees the hang-up and connects at once,
    so its first lookup (and a store or load) after the restart is answered
    by the new service, not turned into a miss by the reconnect back-off."""
    nvme = {"path": str(tmp_path / "nvme"), "region_size": "512KiB", "io_chunk": "128KiB"}
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "4MiB"},
                                             {"adapter": "nvme", "capacity": "32MiB", "options": nvme}])
    proc = start_service(cfg_path, sock)
    for use_index in (True, False):
        client = CacheClient(sock, retry_s=60.0, use_index=use_index)  # a miss would last a minute
        try:
            keys, data = chain(80, 50 + use_index)  # 5 MiB: the prefix is demoted to NVMe
            assert client.store(keys, data).wait(30) == [Outcome.DONE] * 80
            n = client.locate(keys).index("dram")
            assert n > 0 and client.flush()
            stop(proc)
            proc = start_service(cfg_path, sock)
            assert client.lookup(keys) == n  # restored from the NVMe log by the new service
            out = [bytearray(SIZE) for _ in keys[:n]]
            assert client.load(keys[:n], out).wait(30) == [Outcome.DONE] * n
            assert [bytes(o) for o in out] == data[:n]
        finally:
            client.close()
    stop(proc)


def test_lookups_beside_requests_of_other_threads_never_raise(tmp_path):
    """A lookup (the key index, under the index lock) and a request (under
    the client's lock) both ask whether the service hung up; one poll object
    refuses two poll() calls at once, which raised RuntimeError into the
    engine's thread (SGLang's prefetch thread beside its backup thread)."""
    cfg_path, sock = write_config(tmp_path, [{"adapter": "dram", "capacity": "4MiB"}])
    proc = start_service(cfg_path, sock)
    client = CacheClient(sock)
    errors, stop_at = [], time.monotonic() + 3.0
    k, d = chain(4, 9)

    def look():
        while time.monotonic() < stop_at:
            try:
                client.lookup(k)
            except Exception as exc:
                errors.append(repr(exc))
                return

    try:
        assert client.store(k, d).wait(10) == [Outcome.DONE] * 4
        threads = [threading.Thread(target=look) for _ in range(2)]
        for t in threads:
            t.start()
        while time.monotonic() < stop_at and not errors:
            client.stats()
        for t in threads:
            t.join(10)
        assert errors == []
    finally:
        client.close()
        stop(proc)
