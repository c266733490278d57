"""`ucm serve`: the cache service, one per node, shared by every engine process.

It hosts a UnifiedCache. Control goes over a Unix domain socket (mode 0600
in a 0700 per-user directory) with the msgpack protocol of
ucm.service.protocol; payload bytes go through the shared-memory dram arena,
which clients map: a client copies into a reserved slot and commits, or
copies out of a leased slot. One thread serves each connection.

A connection owns its reservations, leases and pins; when it closes (the
client exited or was killed) they are given back. The service itself may be
killed at any instant: it persists nothing but the NVMe log, and a restart
serves what that log had sealed.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

from ucm import __version__
from ucm.cache import UnifiedCache
from ucm.config import UcmConfig
from ucm.errors import ConfigError, UcmError
from ucm.service import protocol as proto
from ucm.service.metrics import Metrics

log = logging.getLogger(__name__)


def runtime_dir() -> str:
    """The per-user directory of sockets (created 0700, checked to be ours)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "ucm") if base and os.access(base, os.W_OK) else f"/tmp/ucm-{os.getuid()}"
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UcmError(f"runtime directory {path!r} must be owned by uid {os.getuid()} with mode 0700 "
                       f"(found uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return path


def socket_path(config: UcmConfig) -> str:
    return config.service.socket or os.path.join(runtime_dir(), f"{config.service.name}.sock")


def remove_stale_segments(directory: str) -> int:
    """Unlinks arena files left by killed services of this user."""
    prefix = f"ucm-{os.getuid()}-"
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # its owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


class _Conn:
    """State a connection owns; given back when it closes."""

    def __init__(self, sock: socket.socket, cid: int) -> None:
        self.sock = sock
        self.id = cid
        self.leases: dict[int, Any] = {}
        self.reserved: set[bytes] = set()
        self.pins: Counter = Counter()
        self.next_lease = 1
        self.reader: Optional[proto.FrameReader] = None


class CacheService:
    """Hosts a UnifiedCache behind a Unix socket and a shared arena."""

    def __init__(self, config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> None:
        self.config = config
        self.private = private
        self.idle_exit_s = idle_exit_s
        self.path = socket_path(config)
        self.cache: Optional[UnifiedCache] = None
        self._sock: Optional[socket.socket] = None
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_active = time.monotonic()
        self._next_conn = 1
        self.metrics: Optional[Metrics] = None
        self._ops: dict[str, Callable[[_Conn, dict], Any]] = {
            "hello": self._hello, "lookup": self._lookup, "locate": self._locate,
            "reserve": self._reserve, "commit": self._commit, "abort": self._abort,
            "acquire": self._acquire, "release": self._release, "prefetch": self._prefetch,
            "pin": self._pin, "unpin": self._unpin, "stats": self._stats, "flush": self._flush,
        }

    # ---- life cycle --------------------------------------------------------
    def start(self) -> None:
        self._sock = self._bind()  # fails fast when another service owns the socket
        try:
            dram = [t for t in self.config.tiers if t.adapter == "dram"]
            if self.config.landing_tier != "dram" or not dram:
                raise ConfigError("landing_tier: the service needs 'dram' as its landing tier "
                                  f"(the shared data plane), got {self.config.landing_tier!r}")
            remove_stale_segments(dram[0].options.get("path", "/dev/shm"))
            self.cache = UnifiedCache(self.config)
            if self.config.service.metrics_port is not None:
                self.metrics = Metrics(self.cache, self.config.service.metrics_host,
                                       self.config.service.metrics_port)
        except BaseException:
            self._sock.close()
            self._unlink_socket()
            raise
        log.info("ucm serve: listening on %s (arena %s)", self.path, self.cache.shared_arena().segment_path)

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(self.path)
                    probe.close()
                    sock.close()
                    raise UcmError(f"a ucm service already listens on {self.path}") from None
                except (ConnectionRefusedError, FileNotFoundError):
                    probe.close()
                    os.unlink(self.path)  # left by a killed service
                    sock.bind(self.path)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        sock.listen(128)  # clients that come early wait in the backlog until the cache is ready
        return sock

    def serve_forever(self) -> None:
        assert self._sock is not None
        self._sock.settimeout(0.5)
        try:
            while not self._stop.is_set():
                try:
                    client, _ = self._sock.accept()
                except socket.timeout:
                    if self.private and self._idle():
                        log.info("ucm serve: private service idle, exiting")
                        break
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                with self._lock:
                    cid = self._next_conn
                    self._next_conn += 1
                    conn = _Conn(client, cid)
                    self._conns[cid] = conn
                    self._last_active = time.monotonic()
                threading.Thread(target=self._serve_conn, args=(conn,), name=f"ucm-conn-{cid}",
                                 daemon=True).start()
        finally:
            self.close()

    def _idle(self) -> bool:
        with self._lock:
            return not self._conns and time.monotonic() - self._last_active > self.idle_exit_s

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._unlink_socket()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.metrics is not None:
            self.metrics.close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    def _unlink_socket(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- connections -------------------------------------------------------
    def _serve_conn(self, conn: _Conn) -> None:
        reader = proto.FrameReader(conn.sock, self.config.service.max_frame_bytes)
        try:
            while not self._stop.is_set():
                try:
                    frame = reader.read()
                except proto.ProtocolError as exc:
                    log.warning("ucm serve: connection %d: %s; closing it", conn.id, exc)
                    self._send(conn, [0, False, str(exc)])
                    break
                if frame is None:
                    break
                if not (isinstance(frame, list) and len(frame) == 3 and isinstance(frame[0], int)
                        and isinstance(frame[1], str)):
                    self._send(conn, [0, False, "request must be [id:int, op:str, args:map]"])
                    continue
                rid, op, args = frame
                handler = self._ops.get(op)
                t0 = time.perf_counter()
                if handler is None:
                    reply = [rid, False, f"unknown op {op!r}; known: {sorted(self._ops)}"]
                else:
                    try:
                        reply = [rid, True, handler(conn, args)]
                    except (proto.ProtocolError, UcmError) as exc:
                        reply = [rid, False, str(exc)]
                    except Exception as exc:  # a bug in one request must not take the service down
                        log.exception("ucm serve: op %s failed", op)
                        reply = [rid, False, f"internal error: {type(exc).__name__}: {exc}"]
                if self.metrics is not None and handler is not None:
                    self.metrics.observe(op, time.perf_counter() - t0)
                if not self._send(conn, reply):
                    break
        except OSError:
            pass
        finally:
            self._drop_conn(conn)

    def _send(self, conn: _Conn, reply: list) -> bool:
        try:
            conn.sock.sendall(proto.pack(reply))
            return True
        except OSError:
            return False

    def _drop_conn(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.pop(conn.id, None)
            self._last_active = time.monotonic()
        cache = self.cache
        if cache is not None:
            if conn.leases:
                cache.release(list(conn.leases.values()))
            if conn.reserved:
                cache.abort(list(conn.reserved))
            if conn.pins:
                cache.unpin(list(conn.pins.elements()))
        conn.leases.clear()
        conn.reserved.clear()
        conn.pins.clear()
        try:
            conn.sock.close()
        except OSError:
            pass

    # ---- operations --------------------------------------------------------
    def _keys(self, args: dict, allowed: set[str], name: str = "keys") -> list[bytes]:
        proto.check_args(args, allowed)
        return proto.keys_arg(args, name, self.config.service.max_keys)

    def _hello(self, conn: _Conn, args: dict) -> dict:
        proto.check_args(args, {"version"})
        if args.get("version") != proto.VERSION:
            raise proto.ProtocolError(f"protocol version {args.get('version')!r} not supported; "
                                      f"this service speaks {proto.VERSION}")
        arena = self.cache.shared_arena()
        return {"version": proto.VERSION, "ucm": __version__, "pid": os.getpid(),
                "arena_path": arena.segment_path, "arena_bytes": arena.capacity_bytes,
                "block_tokens": self.config.block_tokens, "tiers": self.cache.tier_names}

    def _lookup(self, conn: _Conn, args: dict) -> int:
        return self.cache.lookup(self._keys(args, {"keys"}))

    def _locate(self, conn: _Conn, args: dict) -> list:
        return self.cache.locate(self._keys(args, {"keys"}))

    def _reserve(self, conn: _Conn, args: dict) -> list:
        keys = self._keys(args, {"keys", "sizes", "parent"})
        arena = self.cache.shared_arena()
        sizes = proto.ints_arg(args, "sizes", len(keys), 1, arena.capacity_bytes)
        parent = proto.opt_key_arg(args, "parent")
        out = []
        for key, r in zip(keys, self.cache.reserve(keys, sizes, parent)):
            if r is None or r is True:
                out.append(r)
                continue
            r.release()
            off = arena.slot_offset(key)
            conn.reserved.add(key)
            out.append([off[0], off[1]])
        return out

    def _commit(self, conn: _Conn, args: dict) -> list:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        return self.cache.commit(keys)

    def _abort(self, conn: _Conn, args: dict) -> None:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        self.cache.abort(keys)

    def _acquire(self, conn: _Conn, args: dict) -> list:
        keys = self._keys(args, {"keys"})
        out = []
        for lease in self.cache.acquire(keys):
            if lease is None:
                out.append(None)
                continue
            lid = conn.next_lease
            conn.next_lease += 1
            conn.leases[lid] = lease
            out.append([lid, lease.slot.offset, lease.slot.length])
        return out

    def _release(self, conn: _Conn, args: dict) -> None:
        proto.check_args(args, {"leases"})
        ids = args.get("leases")
        if not isinstance(ids, list) or len(ids) > self.config.service.max_keys:
            raise proto.ProtocolError("leases: expected a list of lease ids")
        self.cache.release([conn.leases.pop(i) for i in ids if isinstance(i, int) and i in conn.leases])

    def _prefetch(self, conn: _Conn, args: dict) -> list:
        h = self.cache.prefetch(self._keys(args, {"keys"}))
        res = h.wait(self.config.service.request_timeout_s)
        return [o.value for o in res] if res is not None else ["failed"] * len(h.results)

    def _pin(self, conn: _Conn, args: dict) -> None:
        keys = self._keys(args, {"keys"})
        self.cache.pin(keys)
        conn.pins.update(keys)

    def _unpin(self, conn: _Conn, args: dict) -> None:
        keys = [k for k in self._keys(args, {"keys"}) if conn.pins.get(k)]
        conn.pins.subtract(keys)
        conn.pins += Counter()  # drop zero counts
        self.cache.unpin(keys)

    def _stats(self, conn: _Conn, args: dict) -> dict:
        proto.check_args(args, set())
        s = self.cache.stats()
        with self._lock:
            s["service"] = {"pid": os.getpid(), "socket": self.path, "connections": len(self._conns),
                            "leases": sum(len(c.leases) for c in self._conns.values()),
                            "metrics": self.metrics.address if self.metrics else None}
        return s

    def _flush(self, conn: _Conn, args: dict) -> bool:
        proto.check_args(args, set())
        return self.cache.flush()


def serve(config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> int:
    """Runs the service until SIGTERM/SIGINT (or idle, when private)."""
    svc = CacheService(config, private=private, idle_exit_s=idle_exit_s)
    svc.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: svc.stop())
    print(f"ucm serve: listening on {svc.path}", flush=True)
    svc.serve_forever()
    return 0
