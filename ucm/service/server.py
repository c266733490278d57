"""`ucm serve`: the cache service, one per node, shared by every engine process.

It hosts a UnifiedCache. Control goes over a Unix domain socket (mode 0600
in a 0700 per-user directory) with the msgpack protocol of
ucm.service.protocol; payload bytes go through the shared-memory dram arena,
which clients map: a client copies into a reserved slot and commits, or
copies out of a leased slot. One event loop answers every connection;
operations that may wait on I/O (reserve, commit, acquire, prefetch, flush)
run on a small worker pool, one at a time per connection.

A connection owns its reservations, leases and pins; when it closes (the
client exited or was killed) they are given back. The service itself may be
killed at any instant: it persists nothing but the NVMe log, and a restart
serves what that log had sealed.
"""
from __future__ import annotations

import errno
import faulthandler
import logging
import os
import queue
import secrets
import selectors
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from ucm import __version__
from ucm.cache import UnifiedCache
from ucm.config import UcmConfig
from ucm.errors import ConfigError, UcmError
from ucm.service import protocol as proto
from ucm.service.index import KeyIndex
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

    def __init__(self, sock: socket.socket, cid: int, max_frame_bytes: int) -> None:
        self.sock = sock
        self.id = cid
        self.leases: dict[int, Any] = {}
        self.reserved: set[bytes] = set()
        self.pins: Counter = Counter()
        self.next_lease = 1
        self.decoder = proto.FrameDecoder(max_frame_bytes)
        self.out = bytearray()  # reply bytes the socket did not take yet
        self.busy = False  # a request of this connection runs on the worker pool
        self.closing = False  # drop once the running request is done


class CacheService:
    """Hosts a UnifiedCache behind a Unix socket and a shared arena."""

    def __init__(self, config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> None:
        self.config = config
        self.private = private
        self.idle_exit_s = idle_exit_s
        self.path = socket_path(config)
        self.cache: Optional[UnifiedCache] = None
        self.index: Optional[KeyIndex] = None
        self._sock: Optional[socket.socket] = None
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_active = time.monotonic()
        self._next_conn = 1
        self.metrics: Optional[Metrics] = None
        # This instance's identity: every slot it hands out carries it, so a
        # client never fills a slot through another instance's arena.
        self.epoch = secrets.randbits(62)
        self._arena_inode = 0
        self._sel: Optional[selectors.BaseSelector] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._done: "queue.SimpleQueue[tuple[_Conn, bytes]]" = queue.SimpleQueue()
        self._running: dict[int, tuple[str, float, bool]] = {}  # worker thread -> (op, start, logged)
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._ops: dict[str, Callable[[_Conn, dict], Any]] = {
            "hello": self._hello, "lookup": self._lookup, "locate": self._locate,
            "reserve": self._reserve, "commit": self._commit, "abort": self._abort,
            "acquire": self._acquire, "release": self._release, "prefetch": self._prefetch,
            "pin": self._pin, "unpin": self._unpin, "finish": self._finish,
            "stats": self._stats, "flush": self._flush,
        }
        # Operations that may wait on I/O (NVMe reads and writes, evictions,
        # cluster stores) run on worker threads; the rest answer on the loop.
        self._slow_ops = {"reserve", "commit", "acquire", "prefetch", "flush"}
        # Unsent reply bytes past which a connection is not read from until
        # its client takes them (a client that stops reading cannot grow the
        # service's memory).
        self._out_limit = 1 << 20

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
            if self.config.service.index_slots:
                self.index = KeyIndex(dram[0].options.get("path", "/dev/shm"), self.config.service.index_slots)
                self.cache.watch_keys(self.index.add, self.index.discard)
            if self.config.service.metrics_port is not None:
                self.metrics = Metrics(self.cache, self.config.service.metrics_host,
                                       self.config.service.metrics_port)
        except BaseException:
            self._sock.close()
            self._unlink_socket()
            if self.cache is not None:
                self.cache.close()
            if self.index is not None:
                self.index.close()
            raise
        self._arena_inode = os.stat(self.cache.shared_arena().segment_path).st_ino
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
        """One event loop answers every connection (no thread hand-offs on
        the hot path: lookups, pins, releases); operations that may block
        on I/O go to a small worker pool and answer from there."""
        assert self._sock is not None
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pool = ThreadPoolExecutor(max_workers=max(2, self.config.io_workers),
                                        thread_name_prefix="ucm-serve")
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        threading.Thread(target=self._watchdog, name="ucm-serve-watchdog", daemon=True).start()
        spin = self.config.service.poll_spin_us / 1e6
        busy_until = 0.0
        try:
            while not self._stop.is_set():
                # Poll while requests keep coming (see service.poll_spin_us).
                events = self._sel.select(0 if time.perf_counter() < busy_until else 0.5)
                if events:
                    busy_until = time.perf_counter() + spin
                elif time.perf_counter() < busy_until:
                    continue
                if not events and self.private and self._idle():
                    log.info("ucm serve: private service idle, exiting")
                    break
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._completions()
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush_out(conn)
                        if mask & selectors.EVENT_READ and not conn.closing:
                            self._readable(conn)
        finally:
            self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self._stop.is_set():
                    return
                raise
            client.setblocking(False)
            with self._lock:
                cid = self._next_conn
                self._next_conn += 1
                conn = _Conn(client, cid, self.config.service.max_frame_bytes)
                self._conns[cid] = conn
                self._last_active = time.monotonic()
            self._sel.register(client, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(max(65536, conn.decoder.need()))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_conn(conn)
            return
        conn.decoder.feed(data)
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Answers the buffered requests of `conn` until one goes to the
        pool (the connection then waits for it: requests stay in order)."""
        while not conn.busy and not conn.closing and len(conn.out) <= self._out_limit:
            try:
                frame = conn.decoder.next()
            except proto.ProtocolError as exc:
                log.warning("ucm serve: connection %d: %s; closing it", conn.id, exc)
                self._reply(conn, proto.pack([0, False, str(exc)]))
                self._close_conn(conn, after_send=True)
                return
            if frame is proto.NEED_MORE:
                return
            if not (isinstance(frame, list) and len(frame) == 3 and isinstance(frame[0], int)
                    and isinstance(frame[1], str)):
                self._reply(conn, proto.pack([0, False, "request must be [id:int, op:str, args:map]"]))
                continue
            if frame[1] in self._slow_ops:
                conn.busy = True
                self._pool.submit(self._run_slow, conn, frame)
                return
            self._reply(conn, self._handle(conn, frame))

    def _handle(self, conn: _Conn, frame: list) -> bytes:
        rid, op, args = frame
        handler = self._ops.get(op)
        if handler is None:
            return proto.pack([rid, False, f"unknown op {op!r}; known: {sorted(self._ops)}"])
        t0 = time.perf_counter()
        try:
            reply = [rid, True, handler(conn, args)]
        except (proto.ProtocolError, UcmError) as exc:
            reply = [rid, False, str(exc)]
        except Exception as exc:  # a bug in one request must not take the service down
            log.exception("ucm serve: op %s failed", op)
            reply = [rid, False, f"internal error: {type(exc).__name__}: {exc}"]
        if self.metrics is not None:
            self.metrics.observe(op, time.perf_counter() - t0)
        return proto.pack(reply)

    def _run_slow(self, conn: _Conn, frame: list) -> None:
        me = threading.get_ident()
        with self._lock:
            self._running[me] = (frame[1], time.monotonic(), False)
        try:
            out = self._handle(conn, frame)
        except BaseException as exc:  # pack failed: never leave the connection busy
            out = proto.pack([frame[0], False, f"internal error: {type(exc).__name__}"])
        finally:
            with self._lock:
                self._running.pop(me, None)
        self._done.put((conn, out))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the wake pipe is full: the loop is awake anyway

    def _watchdog(self) -> None:
        """Logs, once per request, an operation that has run for a third of
        the clients' request timeout, with every thread's stack: what a
        request that clients will give up on waits for."""
        limit = self.config.service.request_timeout_s / 3
        while not self._stop.wait(min(1.0, limit / 2)):
            now = time.monotonic()
            with self._lock:
                stuck = [(t, op, now - t0) for t, (op, t0, told) in self._running.items()
                         if not told and now - t0 > limit]
                for t, op, _ in stuck:
                    self._running[t] = (op, self._running[t][1], True)
            for t, op, age in stuck:
                log.warning("ucm serve: %s has run for %.1f s (thread %d); stacks follow", op, age, t)
                faulthandler.dump_traceback(all_threads=True)

    def _completions(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn, out = self._done.get_nowait()
            except queue.Empty:
                return
            conn.busy = False
            if conn.closing:
                self._drop_conn(conn)
                continue
            self._reply(conn, out)
            self._dispatch(conn)

    def _reply(self, conn: _Conn, data: bytes) -> None:
        if conn.out:
            conn.out += data
            if len(conn.out) > self._out_limit and not conn.closing:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)  # stop reading it
            return
        try:
            n = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close_conn(conn)
            return
        if n < len(data):
            conn.out += data[n:]
            reading = selectors.EVENT_READ if len(conn.out) <= self._out_limit else 0
            self._sel.modify(conn.sock, reading | selectors.EVENT_WRITE, conn)

    def _flush_out(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            conn.out.clear()
            self._close_conn(conn)
            return
        throttled = len(conn.out) > self._out_limit
        del conn.out[:n]
        if not conn.out:
            if conn.closing:
                self._close_conn(conn)
            else:
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        elif throttled and len(conn.out) <= self._out_limit and not conn.closing:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        if throttled and len(conn.out) <= self._out_limit and not conn.closing:
            self._dispatch(conn)  # the requests it buffered meanwhile

    def _close_conn(self, conn: _Conn, after_send: bool = False) -> None:
        """Stops serving `conn`; what it owns is given back once no request of
        it runs any more (and, with after_send, once its last reply left)."""
        conn.closing = True
        if after_send and conn.out:
            return
        if conn.busy:
            try:  # a closed socket stays readable: stop watching it meanwhile
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            return  # _completions drops it
        self._drop_conn(conn)

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
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)  # requests in flight finish first
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.busy = False
            self._drop_conn(c)
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.index is not None:
            self.index.close()
            self.index = None

    def _unlink_socket(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # ---- connections -------------------------------------------------------
    def _drop_conn(self, conn: _Conn) -> None:
        with self._lock:
            if self._conns.pop(conn.id, None) is None:
                return  # dropped already
            self._last_active = time.monotonic()
        if self._sel is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
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
        return {"version": proto.VERSION, "ucm": __version__, "pid": os.getpid(), "epoch": self.epoch,
                "arena_path": arena.segment_path, "arena_bytes": arena.capacity_bytes,
                "arena_inode": self._arena_inode,
                "block_tokens": self.config.block_tokens, "tiers": self.cache.tier_names,
                "index_path": self.index.path if self.index else None,
                "index_bytes": self.index.nbytes if self.index else 0,
                "shared_tiers": bool(self.cache._shared)}

    def _lookup(self, conn: _Conn, args: dict) -> int:
        return self.cache.lookup(self._keys(args, {"keys"}))

    def _locate(self, conn: _Conn, args: dict) -> list:
        return self.cache.locate(self._keys(args, {"keys"}))

    def _reserve(self, conn: _Conn, args: dict) -> dict:
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
        return {"epoch": self.epoch, "slots": out}

    def _commit(self, conn: _Conn, args: dict) -> list:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        return self.cache.commit(keys)

    def _abort(self, conn: _Conn, args: dict) -> None:
        keys = [k for k in self._keys(args, {"keys"}) if k in conn.reserved]
        conn.reserved.difference_update(keys)
        self.cache.abort(keys)

    def _acquire(self, conn: _Conn, args: dict) -> dict:
        keys = self._keys(args, {"keys"})
        out = []
        for lease in self.cache.acquire(keys):
            if lease is None:
                out.append(None)
                continue
            lid = conn.next_lease
            conn.next_lease += 1
            conn.leases[lid] = lease
            out.append([lid, lease.offset, lease.length])
        return {"epoch": self.epoch, "slots": out}

    def _release(self, conn: _Conn, args: dict) -> None:
        proto.check_args(args, {"leases"})
        ids = args.get("leases")
        if not isinstance(ids, list) or len(ids) > self.config.service.max_keys:
            raise proto.ProtocolError("leases: expected a list of lease ids")
        self.cache.release([conn.leases.pop(i) for i in ids if type(i) is int and i in conn.leases])

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

    def _finish(self, conn: _Conn, args: dict) -> None:
        keys = self._keys(args, {"keys", "output_tokens"})
        self.cache.finish(keys, proto.int_arg(args, "output_tokens", 0, 1 << 40))

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


def allowed_cpus() -> set[int]:
    """The CPUs processes here may run on: the cgroup's cpuset, else every
    online CPU."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return set(range(os.cpu_count() or 1))
    return cpus or set(range(os.cpu_count() or 1))


def release_inherited_affinity() -> None:
    """A private service is started by an engine process, whose threads are
    often bound to a few cores (vLLM for CPU binds its OpenMP threads with
    VLLM_CPU_OMP_THREADS_BIND, and the worker process to one of them): the
    service must not inherit that binding, or every copy and NVMe request
    of the cache queues behind the engine's spinning threads on one core
    (measured: a 6 MB copy stalled for 30 s). It runs on every CPU allowed
    here instead."""
    want = allowed_cpus()
    try:
        if os.sched_getaffinity(0) != want:
            os.sched_setaffinity(0, want)
    except (OSError, AttributeError) as exc:  # a cpuset that changed meanwhile; non-Linux
        log.info("ucm serve: keeping the inherited CPU affinity (%s)", exc)


def serve(config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> int:
    """Runs the service until SIGTERM/SIGINT (or idle, when private). A
    private service first drops the CPU binding it inherited from the
    engine that started it (release_inherited_affinity); a service started
    by hand keeps whatever `taskset` or the unit file gave it."""
    if private:
        release_inherited_affinity()  # before any thread is started: they inherit it
    svc = CacheService(config, private=private, idle_exit_s=idle_exit_s)
    svc.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: svc.stop())
    # `kill -USR1 <pid>` writes every thread's stack to the service's stderr
    # (its log): what a stuck request waits on, without stopping the service.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(f"ucm serve: listening on {svc.path}", flush=True)
    svc.serve_forever()
    return 0
