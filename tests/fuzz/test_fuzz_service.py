"""A live `ucm serve` fed random bytes and random requests over raw
sockets: it answers or closes each connection (never hangs on one, never
dies), answers a bad request with a refusal (never an internal error), gives
back what a fuzzing connection held once it closes, and a well-behaved
CacheClient gets the right bytes throughout."""
import hashlib
import socket
import time

import pytest
import yaml

from fuzzing import SEED, chunks, examples, mutate, rng, value
from ucm.api import Outcome
from support import start_service, stop_service
from ucm.service import CacheClient
from ucm.service import protocol as proto

SIZE = 64 * 1024
ARENA = 4 << 20
MAX_FRAME = 1 << 16
OPS = ("hello", "begin", "lookup", "locate", "reserve", "commit", "abort", "acquire", "release", "prefetch",
       "pin", "unpin", "finish", "stats", "flush")
REQUEST_IDS = (None, None, "r1", "r2", "", "x" * 257, 5, b"r1", True)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-service")
    sock = str(tmp / "ucm.sock")
    cfg = {"tiers": [{"adapter": "dram", "capacity": ARENA, "options": {"path": str(tmp)}},
                     # Regions larger than the arena: any block the fuzzer reserves can be demoted (a block
                     # larger than a region is refused by nvme and dropped from DRAM).
                     {"adapter": "nvme", "capacity": "64MiB",
                      "options": {"path": str(tmp / "nvme"), "region_size": "8MiB", "io_chunk": "1MiB"}}],
           "policy": {"name": "lru"},
           "service": {"socket": sock, "max_frame_bytes": MAX_FRAME, "max_keys": 64, "index_slots": 1024,
                       "request_timeout_s": 20}}
    (tmp / "ucm.yaml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "serve.log", "w+")
    proc = start_service(tmp / "ucm.yaml", sock, timeout_s=60, log=log)
    yield sock, proc, tmp / "serve.log"
    stop_service(proc)
    log.close()


def chain(n, seed):
    keys, prev = [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    return keys, [hashlib.shake_128(k).digest(SIZE) for k in keys]


def round_trip(client, seed, n=6):
    """Stores a chain and loads it back: every block DONE and byte-exact."""
    keys, data = chain(n, seed)
    assert client.store(keys, data).wait(60) == [Outcome.DONE] * n
    out = [bytearray(SIZE) for _ in keys]
    assert client.load(keys, out).wait(60) == [Outcome.DONE] * n
    assert [bytes(o) for o in out] == data


def read_replies(s, dec, want=None):
    """Reply frames until `want` of them arrived or the service closed the
    connection; a socket timeout (the service neither answered nor closed)
    fails the test."""
    replies = []
    while want is None or len(replies) < want:
        while True:
            frame = dec.next()  # a malformed reply raises ProtocolError and fails the test
            if frame is proto.NEED_MORE:
                break
            assert isinstance(frame, list) and len(frame) == 3 and isinstance(frame[0], int) \
                and isinstance(frame[1], bool), frame
            replies.append(frame)
        if want is not None and len(replies) >= want:
            break
        try:
            data = s.recv(1 << 16)
        except ConnectionResetError:
            data = b""
        if not data:
            return replies, True
        dec.feed(data)
    return replies, False


def test_random_bytes_never_hang_or_kill_the_service(service):
    sock, proc, _ = service
    rnd = rng("service_bytes")
    good = CacheClient(sock)
    try:
        round_trip(good, 1)
        valid = [proto.pack([rnd.randrange(1 << 32), op, {"keys": [rnd.randbytes(16)]}]) for op in OPS]
        for n in range(examples(300)):
            r = rnd.random()
            if r < 0.3:
                stream = rnd.randbytes(rnd.randrange(1, 200))
            elif r < 0.5:
                body = rnd.randbytes(rnd.randrange(0, 200))
                stream = len(body).to_bytes(4, "little") + body
            elif r < 0.6:  # a frame announcing more than the service accepts, or than it sends
                stream = rnd.choice((MAX_FRAME + 1, 1 << 31, (1 << 32) - 1)).to_bytes(4, "little") + b"\x90"
            else:
                stream = mutate(rnd, b"".join(rnd.sample(valid, rnd.randint(1, 4))), rounds=rnd.randint(1, 3))
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(20)
            s.connect(sock)
            try:
                for part in chunks(rnd, stream):
                    s.sendall(part)
                s.shutdown(socket.SHUT_WR)
                read_replies(s, proto.FrameDecoder(1 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the service closed a connection whose frame it refused
            finally:
                s.close()
            assert proc.poll() is None, (SEED, n, stream)
            if n % 20 == 0:
                round_trip(good, 100 + n)
        round_trip(good, 2)
    finally:
        good.close()


def fuzz_request(rnd, rid, own, good_keys):
    """A random request: a known op (sometimes not), arguments that are
    mostly well formed. Writes (reserve, commit) only name this
    connection's own keys, so the good client's blocks keep their bytes."""
    op = rnd.choice(OPS) if rnd.random() < 0.95 else rnd.choice(("", "nope", "__init__", "_ops"))
    pool = own if op in ("reserve", "commit", "abort") else own + good_keys
    keys = [rnd.choice(pool) for _ in range(rnd.choice((0, 1, 2, 3, 8)))]
    args = {"keys": keys}
    if op == "reserve":
        sizes = [rnd.choice((1, 4096, SIZE, SIZE + 1, ARENA // 2, ARENA, ARENA + 1, 0, -1)) for _ in keys]
        args.update(sizes=sizes, parent=rnd.choice((None, rnd.choice(pool), b"short")))
    elif op == "release":
        args = {"leases": [rnd.choice((1, 2, 3, 5, 1 << 40, -1, True, None, "x")) for _ in keys]}
    elif op == "hello":
        args = {"version": rnd.choice((proto.VERSION, proto.VERSION, 0, 2, "1", None))}
    elif op == "finish":
        args["output_tokens"] = rnd.choice((0, 200, 1 << 40, (1 << 40) + 1, -1, 1.5, True))
    elif op in ("stats", "flush"):
        args = {}
    if op == "begin":
        args.update(parent=rnd.choice((None, rnd.choice(pool), b"short")))
    if op in ("begin", "reserve", "acquire", "finish"):
        args["request_id"] = rnd.choice(REQUEST_IDS)
    r = rnd.random()
    if r < 0.15:  # one argument replaced by anything
        args[rnd.choice(list(args) + ["extra"])] = value(rnd, 2)
    elif r < 0.2:
        args = value(rnd, 2)
    if rnd.random() < 0.05:
        return [rid, op]  # not [id, op, args]
    return [rid, op, args]


def test_random_requests_are_refused_never_internal_errors_and_give_back_what_they_held(service):
    sock, proc, log_path = service
    rnd = rng("service_requests")
    good = CacheClient(sock)
    good_keys = chain(6, 3)[0]
    replies_by_kind = {"ok": 0, "refused": 0}
    try:
        round_trip(good, 3)
        for conn_no in range(examples(120)):
            own = [rnd.randbytes(16) for _ in range(6)]
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(30)
            s.connect(sock)
            dec = proto.FrameDecoder(1 << 20)
            try:
                for n in range(rnd.randint(5, 40)):
                    req = fuzz_request(rnd, n + 1, own, good_keys)
                    try:
                        s.sendall(proto.pack(req))
                    except (UnicodeEncodeError, OverflowError):
                        continue  # not encodable on this side either
                    (reply,), closed = read_replies(s, dec, want=1)
                    assert not closed
                    assert reply[0] == (n + 1 if len(req) == 3 else 0), (SEED, conn_no, req, reply)
                    if not reply[1]:
                        assert isinstance(reply[2], str) and not reply[2].startswith("internal error"), \
                            (SEED, conn_no, req, reply)
                    replies_by_kind["ok" if reply[1] else "refused"] += 1
            finally:
                s.close()
            assert proc.poll() is None
            if conn_no % 10 == 0:
                round_trip(good, 200 + conn_no)
        assert replies_by_kind["ok"] and replies_by_kind["refused"], replies_by_kind
        # Every fuzzing connection is closed: what they leased, reserved and pinned is back.
        deadline = time.monotonic() + 20
        while True:
            svc = good.stats()["service"]
            if svc["leases"] == 0 and svc["connections"] == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (svc["leases"], svc["connections"]) == (0, 1)
        # Every slot is usable again: more blocks than the arena holds go in, and come back exact.
        keys, data = chain(ARENA // SIZE + 16, 4)
        assert good.store(keys, data).wait(60) == [Outcome.DONE] * len(keys)
        out = [bytearray(SIZE) for _ in keys]
        assert good.load(keys, out).wait(60) == [Outcome.DONE] * len(keys)
        assert [bytes(o) for o in out] == data
    finally:
        good.close()
    assert "Traceback" not in log_path.read_text()


def test_stalled_and_half_sent_frames_do_not_hold_up_other_clients(service):
    """One event loop serves every connection: peers that stop mid-frame,
    or connect and say nothing, never block a well-behaved client."""
    sock, proc, _ = service
    rnd = rng("service_stalls")
    stalled = []
    try:
        for n in range(examples(40)):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            frame = proto.pack([n, "lookup", {"keys": [rnd.randbytes(16)]}])
            s.sendall(frame[:rnd.randrange(0, len(frame))])  # a prefix of a frame, then silence
            stalled.append(s)
        with CacheClient(sock) as good:
            round_trip(good, 5)
            assert good.stats()["service"]["connections"] == len(stalled) + 1
    finally:
        for s in stalled:
            s.close()
    assert proc.poll() is None
