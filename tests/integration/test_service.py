"""`ucm serve` with real client processes, kills, and malformed frames."""
import json
import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request

import msgpack
import pytest
import yaml

from ucm.api import Outcome
from ucm.errors import ArgumentError, UcmError
from ucm.service import CacheClient
from ucm.service import protocol as proto
from support import chain, start_service

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZE = 64 * 1024


def write_config(tmp_path, metrics=False, accelerators=()):
    sock = str(tmp_path / "ucm.sock")
    cfg = {
        "tiers": [{"adapter": "dram", "capacity": "4MiB"},
                  {"adapter": "nvme", "capacity": "32MiB",
                   "options": {"path": str(tmp_path / "nvme"), "region_size": "512KiB", "io_chunk": "128KiB"}}],
        "policy": {"name": "lru"},
        "service": {"socket": sock, "metrics_port": 0 if metrics else None},
        "accelerators": list(accelerators),
    }
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), sock, cfg


@pytest.fixture
def service(tmp_path):
    cfg_path, sock, cfg = write_config(tmp_path, metrics=True)
    proc = start_service(cfg_path, sock)
    yield cfg_path, sock, cfg, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_client(script, cfg_path, *args, background=False):
    code = textwrap.dedent(script)
    cmd = [sys.executable, "-c", code, cfg_path, *map(str, args)]
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


STORE = """
    import sys, hashlib
    from ucm.service import CacheClient
    from ucm.config.schema import load_config
    from ucm.service.paths import socket_path
    cfg = load_config(sys.argv[1]); n = int(sys.argv[2]); seed = int(sys.argv[3])
    keys, data, prev = [], [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev); data.append(hashlib.shake_128(prev).digest(65536))
    c = CacheClient(socket_path(cfg), cfg)
    res = c.store(keys, data).wait(60)
    print(sum(r.value == "done" for r in res))
    c.close()
"""

LOAD = """
    import sys, hashlib
    from ucm.service import CacheClient
    from ucm.config.schema import load_config
    from ucm.service.paths import socket_path
    cfg = load_config(sys.argv[1]); n = int(sys.argv[2]); seed = int(sys.argv[3])
    keys, prev = [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    c = CacheClient(socket_path(cfg), cfg)
    hit = c.lookup(keys)
    out = [bytearray(65536) for _ in keys]
    res = c.load(keys, out).wait(60)
    good = sum(r.value == "done" and bytes(o) == hashlib.shake_128(k).digest(65536) for k, r, o in zip(keys, res, out))
    print(hit, good)
    c.close()
"""


def test_two_processes_share_blocks(service):
    cfg_path, sock, cfg, _ = service
    assert run_client(STORE, cfg_path, 20, 1).split() == ["20"]
    assert run_client(LOAD, cfg_path, 20, 1).split() == ["20", "20"]


def test_concurrent_stores_of_the_same_keys_leave_one_intact_copy(service):
    cfg_path, sock, cfg, _ = service
    procs = [run_client(STORE, cfg_path, 30, 2, background=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs == [["30"], ["30"]]
    assert run_client(LOAD, cfg_path, 30, 2).split() == ["30", "30"]
    with CacheClient(sock) as c:
        s = c.stats()
        assert s["stored_blocks"] == 30  # each block written once


HOLD = """
    import sys, time, hashlib
    from ucm.service import CacheClient
    from ucm.config.schema import load_config
    from ucm.service.paths import socket_path
    cfg = load_config(sys.argv[1]); n = int(sys.argv[2]); seed = int(sys.argv[3])
    keys, prev = [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    c = CacheClient(socket_path(cfg), cfg)
    leases = c.connection.call("acquire", {"keys": keys})
    half = c.connection.call("reserve", {"keys": [hashlib.blake2b(b"x%d" % i, digest_size=16).digest() for i in range(3)],
                               "sizes": [65536] * 3, "parent": None})
    print(sum(l is not None for l in leases["slots"]), sum(isinstance(h, list) for h in half["slots"]), flush=True)
    time.sleep(600)
"""


def test_killed_client_gives_back_its_leases(service):
    cfg_path, sock, cfg, _ = service
    run_client(STORE, cfg_path, 10, 3)
    proc = run_client(HOLD, cfg_path, 10, 3, background=True)
    assert proc.stdout.readline().split() == ["10", "3"]
    with CacheClient(sock) as c:
        assert c.stats()["service"]["leases"] == 10
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 10
        while c.stats()["service"]["leases"] and time.time() < deadline:
            time.sleep(0.05)
        assert c.stats()["service"]["leases"] == 0
        assert c.stats()["service"]["connections"] == 1
        # The half-written reservations were taken back; the service still serves.
        assert run_client(LOAD, cfg_path, 10, 3).split() == ["10", "10"]
        k, d = chain(70, 4)  # more than the 4 MiB arena: every slot must be reusable
        assert c.store(k, d).wait(60) == [Outcome.DONE] * 70


def test_service_killed_and_restarted(tmp_path):
    cfg_path, sock, cfg = write_config(tmp_path)
    proc = start_service(cfg_path, sock)
    client = CacheClient(sock)
    try:
        keys, data = chain(80, 5)  # 5 MiB: part of it is demoted to NVMe
        assert client.store(keys, data).wait(60) == [Outcome.DONE] * 80
        on_nvme = [k for k, t in zip(keys, client.locate(keys)) if t == "nvme"]
        assert on_nvme and client.flush()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # Down: misses and failures as values, never exceptions.
        assert client.lookup(keys) == 0
        out = [bytearray(SIZE) for _ in on_nvme]
        assert set(client.load(on_nvme, out).wait(30)) == {Outcome.MISSING}
        k2, d2 = chain(3, 6)
        assert set(client.store(k2, d2).wait(30)) == {Outcome.FAILED}
        proc = start_service(cfg_path, sock)
        deadline = time.time() + 10
        while client.lookup(on_nvme) == 0 and time.time() < deadline:
            time.sleep(0.1)
        assert client.locate(on_nvme) == ["nvme"] * len(on_nvme)
        out = [bytearray(SIZE) for _ in on_nvme]
        assert client.load(on_nvme, out).wait(30) == [Outcome.DONE] * len(on_nvme)
        expect = dict(zip(keys, data))
        assert [bytes(o) for o in out] == [expect[k] for k in on_nvme]
    finally:
        client.close()
        proc.kill()
        proc.wait()


def test_malformed_frames_never_crash_the_service(service):
    cfg_path, sock, cfg, proc = service
    rnd = random.Random(7)
    good = msgpack.packb([1, "lookup", {"keys": [b"k" * 16]}])
    frames = [
        b"", b"\x00", b"\xff\xff\xff\xff", struct.pack("<I", 1 << 30) + b"x",
        struct.pack("<I", 10) + b"\xc1" * 10,  # never-used msgpack byte
        proto.pack("not a list"), proto.pack([1, 2, 3]), proto.pack([1, "nope", {}]),
        proto.pack([1, "lookup", {"keys": [b"short"]}]), proto.pack([1, "lookup", {"keys": "x"}]),
        proto.pack([1, "lookup", {"keys": [], "extra": 1}]), proto.pack([1, "reserve", {"keys": [b"k" * 16], "sizes": [-1]}]),
        proto.pack([1, "reserve", {"keys": [b"k" * 16], "sizes": [1 << 40]}]),
        proto.pack([1, "release", {"leases": ["a", None, 5]}]), proto.pack([1, "acquire", {"keys": [1, 2]}]),
        proto.pack([1, "hello", {"version": 99}]), struct.pack("<I", len(good)) + good[:-3],
        proto.pack([1, "finish", {"keys": [b"k" * 16], "output_tokens": -1}]),
        proto.pack([1, "finish", {"keys": [b"k" * 16], "output_tokens": "9"}]),
        proto.pack([1, "finish", {"keys": [b"k" * 16]}]),
    ]
    for _ in range(200):
        n = rnd.randrange(0, 64)
        body = bytes(rnd.getrandbits(8) for _ in range(n))
        frames.append(struct.pack("<I", len(body)) + body if rnd.random() < 0.7 else body)
    for frame in frames:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect(sock)
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass
        finally:
            s.close()
    assert proc.poll() is None
    run_client(STORE, cfg_path, 5, 8)
    assert run_client(LOAD, cfg_path, 5, 8).split() == ["5", "5"]


def test_private_files_and_observability(service):
    cfg_path, sock, cfg, _ = service
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    with CacheClient(sock) as c:
        arena = c.service_info["arena_path"]
        assert stat.S_IMODE(os.stat(arena).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(c.service_info["index_path"]).st_mode) == 0o600
        k, d = chain(4, 9)
        c.store(k, d).wait(30)
        c.load(k, [bytearray(SIZE) for _ in k]).wait(30)
        addr = c.stats()["service"]["metrics"]
    assert addr.startswith("127.0.0.1:")
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    assert 'ucm_tier_used_bytes{tier="dram"}' in text
    assert "ucm_cache_hit_blocks_total 4.0" in text
    assert 'ucm_service_request_seconds_count{op="acquire"}' in text
    assert 'ucm_tier_demotions_in_total{tier="nvme"} 0.0' in text
    assert "ucm_cache_headroom_evictions_total 0.0" in text
    r = subprocess.run([sys.executable, "-m", "ucm.cli", "inspect", "--config", cfg_path, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tiers"]["dram"]["blocks"] == 4
    r = subprocess.run([sys.executable, "-m", "ucm.cli", "inspect", "--config", cfg_path],
                       capture_output=True, text=True, timeout=60)
    assert "dram" in r.stdout and "capacity" in r.stdout
    assert "accelerators: none" in r.stdout


def test_inspect_lists_the_services_accelerators_and_their_counters(tmp_path):
    cfg_path, sock, _ = write_config(tmp_path, accelerators=[{"name": "prefetch"}])
    proc = start_service(cfg_path, sock)
    try:
        c = CacheClient(sock)
        keys, data = chain(3, 12)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 3
        c.begin_request("r1", keys)
        assert c.stats()["accelerators"]["prefetch"]["errors"] == 0
        c.close()
        r = subprocess.run([sys.executable, "-m", "ucm.cli", "inspect", "--config", cfg_path],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("accelerator prefetch:"))
        assert "blocks_issued 0" in line and "errors 0" in line  # a DRAM hit: nothing to stage
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_connect_starts_a_private_service_that_exits_when_unused(tmp_path):
    from ucm.service import connect
    _, sock, cfg = write_config(tmp_path)
    c = connect(cfg)
    try:
        assert c.connected and c.spawned is not None
        k, d = chain(3, 10)
        assert c.store(k, d).wait(30) == [Outcome.DONE] * 3
        c2 = connect(cfg)  # a second engine process shares the same service
        assert c2.spawned is None and c2.lookup(k) == 3
        c2.close()
    finally:
        c.close()
    c.spawned.wait(30)
    assert not os.path.exists(sock)


def test_connect_says_why_a_private_service_did_not_start(tmp_path, caplog, monkeypatch):
    from ucm.service import connect
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # its log stays in tmp_path
    _, sock, cfg = write_config(tmp_path)
    cfg["tiers"][0]["options"] = {"path": str(tmp_path / "no-such-dir")}
    cfg["service"]["name"] = f"nostart-{os.getpid()}"
    with caplog.at_level("WARNING", logger="ucm.service.client.spawn"):
        c = connect(cfg, timeout_s=30)
    try:
        assert not c.connected
        assert c.lookup(chain(2, 11)[0]) == 0  # runs without a cache
    finally:
        c.close()
    assert "cannot create shared-memory file" in caplog.text and "running without a cache" in caplog.text


def test_slot_access_copies_straight_between_arena_and_caller(service):
    """write_slots/read_slots: the caller copies into and out of the arena
    itself (what the vLLM connector does page by page)."""
    from ucm import _native

    cfg_path, sock, cfg, _ = service
    keys, data = chain(6, 7)
    flat = bytearray(b"".join(data))
    with CacheClient(sock) as c:
        def put(first, slots, arena):
            dst = [s[0] for s in slots if s is not None]
            src = [(first + i) * SIZE for i, s in enumerate(slots) if s is not None]
            _native.copy_spans(arena, dst, flat, src, SIZE)

        assert c.write_slots(keys[:4], [SIZE] * 4, put) == [Outcome.DONE] * 4
        # Already cached blocks get no slot; the rest are filled and committed.
        seen = []
        assert c.write_slots(keys, [SIZE] * 6, lambda f, s, a: (seen.extend(s), put(f, s, a))) == [Outcome.DONE] * 6
        assert seen[:4] == [None] * 4 and all(s is not None for s in seen[4:])
        c.finish(keys, 40)  # the placement hint crosses the socket
        assert c.stats()["finished_requests"] == 1
        with pytest.raises(ArgumentError, match="output_tokens"):
            c.finish(keys, -5)
        with pytest.raises(UcmError, match=r"output_tokens: value must be an integer in \[0, "):
            c.connection.call("finish", {"keys": keys, "output_tokens": -5})  # the service checks too

        out = bytearray(len(flat))

        def get(first, slots, arena):
            src = [s[0] for s in slots if s is not None]
            dst = [(first + i) * SIZE for i, s in enumerate(slots) if s is not None]
            _native.copy_spans(out, dst, arena, src, SIZE)

        missing = os.urandom(16)
        res = c.read_slots(keys + [missing], [SIZE] * 6 + [SIZE], get)
        assert res == [Outcome.DONE] * 6 + [Outcome.MISSING]
        assert out == flat
        # A wrong expected size is corrupt, not copied; a fill that raises fails
        # its blocks and gives the leases back.
        assert c.read_slots(keys[:1], [SIZE - 1], get) == [Outcome.CORRUPT]

        def boom(first, slots, arena):
            raise RuntimeError("copy failed")

        assert c.read_slots(keys[:2], [SIZE] * 2, boom) == [Outcome.FAILED] * 2
        assert c.stats()["service"]["leases"] == 0
        fresh, fresh_data = chain(1, 99)
        assert c.write_slots(fresh, [SIZE], boom) == [Outcome.FAILED]
        assert c.lookup(fresh) == 0


def test_lookups_from_the_shared_index_equal_the_service_answers(service):
    """The key index clients read lookups from mirrors the service through
    stores, demotions to NVMe, evictions and partial prefixes."""
    cfg_path, sock, cfg, _ = service
    rng = random.Random(3)
    with CacheClient(sock) as c:
        assert c.reads_index
        chains = [chain(rng.randint(1, 12), seed)[0] for seed in range(40)]
        for step in range(120):
            keys = rng.choice(chains)
            if rng.random() < 0.6:
                c.store(keys, [bytes(SIZE)] * len(keys)).wait(30)
            probe = keys[:rng.randint(1, len(keys))] + ([os.urandom(16)] if rng.random() < 0.3 else [])
            assert c.lookup(probe) == c.connection.call("lookup", {"keys": probe}), step
        # 4 MiB of DRAM and 32 MiB of NVMe hold fewer blocks than were stored:
        # the index followed evictions too.
        every = [k for ch in chains for k in ch]
        assert 0 < sum(c.lookup([k]) for k in every) < len(every)
        assert sum(c.lookup([k]) for k in every) == sum(c.connection.call("lookup", {"keys": [k]}) for k in every)
        # A long request on another thread (it holds the socket) does not hold up lookups.
        import threading
        hit = next(ch for ch in chains if c.lookup(ch[:1]))[:1]
        with c.connection.lock:
            out = []
            t = threading.Thread(target=lambda: out.append(c.lookup(hit)))
            t.start()
            t.join(5)
            assert out == [1]


def test_request_ids_cross_the_socket_and_are_checked_on_both_sides(service):
    """begin_request and the request_id of store, load and finish reach the
    service; a bad id is an ArgumentError here and a refusal there."""
    cfg_path, sock, cfg, _ = service
    keys, data = chain(5, 22)
    with CacheClient(sock) as c:
        c.begin_request("req-1", keys)
        assert c.store(keys, data, request_id="req-1").wait(30) == [Outcome.DONE] * 5
        out = [bytearray(SIZE) for _ in keys]
        assert c.load(keys, out, request_id="req-1").wait(30) == [Outcome.DONE] * 5
        assert [bytes(o) for o in out] == data
        c.finish(keys, 7, request_id="req-1")
        for bad in ("", "x" * 257, 5, b"req"):
            with pytest.raises(ArgumentError, match="request_id"):
                c.store(keys, data, request_id=bad)
            with pytest.raises(ArgumentError, match="request_id"):
                c.begin_request(bad, keys)
        with pytest.raises(ArgumentError, match="request_id"):
            c.begin_request(None, keys)
        for op, args in (("begin", {"request_id": "", "keys": keys}),
                         ("acquire", {"keys": keys, "request_id": 5}),
                         ("reserve", {"keys": keys[:1], "sizes": [SIZE], "request_id": "x" * 257}),
                         ("finish", {"keys": keys, "output_tokens": 1, "request_id": b"r"})):
            with pytest.raises(UcmError, match="refused .*request_id"):
                c.connection.call(op, args)
        assert c.stats()["service"]["leases"] == 0  # the service lives on
        assert c.prefetch(keys, tier="dram").wait(30) == [Outcome.DONE] * 5
        with pytest.raises(ArgumentError, match="landing tier 'dram', got tier='nvme'"):
            c.prefetch(keys, tier="nvme")  # as UnifiedCache answers


def test_a_lease_id_must_be_an_integer_not_a_bool(service):
    """`true` is not lease 1: a release names leases by integer id only."""
    cfg_path, sock, cfg, _ = service
    with CacheClient(sock) as c:
        keys, data = chain(1, 21)
        assert c.store(keys, data).wait(30) == [Outcome.DONE]
        lease = c.connection.call("acquire", {"keys": keys})["slots"][0]
        assert lease[0] == 1 and c.stats()["service"]["leases"] == 1
        c.connection.call("release", {"leases": [True]})
        assert c.stats()["service"]["leases"] == 1
        c.connection.call("release", {"leases": [1]})
        assert c.stats()["service"]["leases"] == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a binding apart")
def test_a_private_service_does_not_inherit_the_engine_cpu_binding(tmp_path):
    """An engine bound to one core (vLLM's OpenMP binding) starts a private
    service: the service runs on every CPU, not queued behind the engine."""
    from ucm.service.server.serve import allowed_cpus

    cfg = {"tiers": [{"adapter": "dram", "capacity": "4MiB"}], "policy": {"name": "lru"},
           "service": {"socket": str(tmp_path / "p.sock")}}
    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    script = textwrap.dedent("""
        import os, sys
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the engine's binding
        import ucm
        c = ucm.connect(sys.argv[1])
        pid = c.service_info["pid"]
        print(sorted(os.sched_getaffinity(pid)), flush=True)
        c.close()
    """)
    r = subprocess.run([sys.executable, "-c", script, str(cfg_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == sorted(allowed_cpus())
