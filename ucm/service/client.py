"""CacheClient: the UnifiedCache API across the process boundary.

Connectors hold a CacheClient and do not care that the cache lives in
`ucm serve`. Control requests go over the Unix socket; payloads are copied
by this process straight into and out of the service's shared-memory arena.

Faults are values: when the service is down or dies mid-request, `lookup`
answers 0, loads report MISSING, stores report FAILED, and the client
reconnects on a later call (at most every `retry_s`) and re-maps the arena
of the restarted service. Only misuse (bad keys or buffers) raises.

Thread-safe: one lock serialises requests on the socket; copies run
outside it on a small pool that completes the Handles; lookups read the
service's shared key index under a lock of their own.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import yaml

from ucm import _native
from ucm.buffers import byte_view
from ucm.cache import Handle, Outcome, check_keys, check_output_tokens
from ucm.config import UcmConfig, load_config
from ucm.errors import ArgumentError, ClosedError, UcmError
from ucm.service import protocol as proto
from ucm.service.index import map_index
from ucm.service.server import runtime_dir, socket_path

log = logging.getLogger(__name__)


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ServiceUnavailable(UcmError):
    """The service could not be reached; callers turn it into misses."""


class CacheClient:
    def __init__(self, path: str, config: Optional[UcmConfig] = None, io_workers: int = 2,
                 retry_s: float = 0.5, connect: bool = True, use_index: bool = True) -> None:
        self.path = path
        self.config = config or UcmConfig()
        self._timeout = self.config.service.request_timeout_s
        self._limit = self.config.service.max_frame_bytes
        self._retry_s = retry_s
        self._spin_s = self.config.service.poll_spin_us / 1e6
        self._lock = threading.Lock()  # one request at a time on the socket
        self._index_lock = threading.Lock()  # the index mapping and the liveness poll
        self._sock: Optional[socket.socket] = None
        self._arena: Optional[mmap.mmap] = None
        self._arena_path: Optional[str] = None
        self.service_info: dict[str, Any] = {}
        self._index: Optional[mmap.mmap] = None  # the service's key index, read-only
        self._index_path: Optional[str] = None
        self._use_index = use_index  # False: every lookup is a request over the socket
        self._poll: Optional[select.poll] = None
        self._rid = 0
        self._next_try = 0.0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="ucm-client")
        self.spawned: Optional[subprocess.Popen] = None
        if connect:
            with self._lock:
                try:
                    self._connect_locked()
                except ServiceUnavailable:
                    pass

    # ---- connection --------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _connect_locked(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            self._next_try = time.monotonic() + self._retry_s
            raise ServiceUnavailable(f"no ucm service at {self.path}: {exc}") from None
        self._sock = sock
        self._reader = proto.FrameReader(sock, self._limit)
        try:
            info = self._request_locked("hello", {"version": proto.VERSION})
        except ServiceUnavailable:
            raise
        if info["arena_path"] != self._arena_path:
            self._map_arena(info["arena_path"], info["arena_bytes"])
        poll = select.poll()
        poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        with self._index_lock:
            if info.get("index_path") != self._index_path:
                if self._index is not None:
                    self._index.close()
                self._index_path = info.get("index_path")
                self._index = (map_index(self._index_path, info["index_bytes"])
                               if self._index_path and self._use_index else None)
            self._poll = poll
        self.service_info = info

    def _map_arena(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            # MAP_POPULATE: map every page now, so copies into slots take no faults.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            # MAP_POPULATE maps shared pages read-only (the first write to each
            # still faults); MADV_POPULATE_WRITE maps them writable without
            # touching their bytes (Linux 5.14+; older kernels refuse it).
            m.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            pass
        old = self._arena
        self._arena, self._arena_path = m, path
        if old is not None:
            try:
                old.close()
            except BufferError:
                pass  # a copy in flight still uses it; it is unmapped with the object

    def _disconnect_locked(self) -> None:
        with self._index_lock:
            self._poll = None  # no lookups from the index until connected again
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._next_try = time.monotonic() + self._retry_s

    def _request_locked(self, op: str, args: dict) -> Any:
        self._rid += 1
        rid = self._rid
        try:
            self._sock.sendall(proto.pack([rid, op, args]))
            reply = self._reader.read(self._spin_s)
        except (OSError, proto.ProtocolError) as exc:
            self._disconnect_locked()
            raise ServiceUnavailable(f"ucm service at {self.path} failed during {op}: {exc}") from None
        if reply is None:
            self._disconnect_locked()
            raise ServiceUnavailable(f"ucm service at {self.path} closed the connection during {op}")
        if not (isinstance(reply, list) and len(reply) == 3 and reply[0] == rid):
            self._disconnect_locked()
            raise ServiceUnavailable(f"ucm service at {self.path} sent a malformed reply to {op}")
        if not reply[1]:
            raise UcmError(f"ucm service refused {op}: {reply[2]}")
        return reply[2]

    def _call(self, op: str, args: dict) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedError("CacheClient used after close()")
            if self._sock is None:
                if time.monotonic() < self._next_try:
                    raise ServiceUnavailable(f"ucm service at {self.path} is down")
                self._connect_locked()
            return self._request_locked(op, args)

    def _try(self, op: str, args: dict, default: Any) -> Any:
        try:
            return self._call(op, args)
        except ServiceUnavailable as exc:
            log.debug("%s", exc)
            return default
        except UcmError as exc:
            if isinstance(exc, ClosedError):
                raise
            log.warning("%s", exc)
            return default

    # ---- the UnifiedCache API ------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        keys = _keys(keys)
        if not keys:
            return 0
        n = self._lookup_index(keys)
        return n if n is not None else self._try("lookup", {"keys": keys}, 0)

    def _lookup_index(self, keys: list[bytes]) -> Optional[int]:
        """The answer from the shared key index, or None to ask the service:
        no index, no live connection, an inconsistent read, or a partial hit
        that blocks other nodes put into a shared tier might extend."""
        # Not under self._lock: a long request (a load from NVMe) on another
        # thread must not hold up lookups.
        with self._index_lock:
            index, poll = self._index, self._poll
            if index is None or poll is None:
                return None
            # A dead service hangs up its end: its index is stale from then on.
            dead = bool(poll.poll(0))
            n = -1 if dead else _native.index_prefix(index, b"".join(keys))
        if dead:
            with self._lock:
                if self._poll is poll:  # not reconnected meanwhile
                    self._disconnect_locked()
            return None
        if n < 0 or (n < len(keys) and self.service_info.get("shared_tiers")):
            return None
        return n

    def locate(self, keys: Sequence[Key]) -> list[Optional[str]]:
        keys = _keys(keys)
        return self._try("locate", {"keys": keys}, [None] * len(keys))

    def pin(self, keys: Sequence[Key]) -> None:
        self._try("pin", {"keys": _keys(keys)}, None)

    def unpin(self, keys: Sequence[Key]) -> None:
        self._try("unpin", {"keys": _keys(keys)}, None)

    def finish(self, keys: Sequence[Key], output_tokens: int) -> None:
        n = check_output_tokens(output_tokens)
        self._try("finish", {"keys": _keys(keys), "output_tokens": n}, None)

    def stats(self) -> dict[str, Any]:
        return self._try("stats", {}, {"available": False})

    def flush(self, timeout_s: float = 60.0) -> bool:
        return bool(self._try("flush", {}, False))

    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None) -> Handle:
        keys = _keys(keys)
        views = _views(keys, srcs, writable=False)
        if parent is not None:
            _keys([parent])
        return self._submit(len(keys), self._store, keys, views, parent)

    def load(self, keys: Sequence[Key], dsts: Sequence[Any]) -> Handle:
        keys = _keys(keys)
        views = _views(keys, dsts, writable=True)
        return self._submit(len(keys), self._load, keys, views)

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        keys = _keys(keys)

        def run() -> list[Outcome]:
            res = self._try("prefetch", {"keys": keys}, None)
            return [Outcome(r) for r in res] if res is not None else [Outcome.FAILED] * len(keys)

        return self._submit(len(keys), run)

    # ---- slot-level access (zero-copy for connectors) ------------------------
    def read_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn) -> list[Outcome]:
        """Leases `keys` (chunks of at most 1/8 of the arena) and calls
        `fill(first, slots, arena)` while they are held: `slots[i]` is the
        (offset, length) of keys[first + i] in the mapped arena, or None when
        it is missing or its length is not sizes[first + i]. The caller copies
        straight out of the arena (e.g. with _native.copy_spans), so a block
        is copied once. Synchronous; faults are outcomes, never exceptions."""
        keys = _keys(keys)
        if len(sizes) != len(keys):
            raise ArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
        out: list[Outcome] = []
        for i, j in self._chunks(sizes):
            out.extend(self._read_chunk(i, keys[i:j], sizes[i:j], fill))
        return out

    def write_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                    parent: Optional[Key] = None) -> list[Outcome]:
        """Reserves slots for `keys` and calls `fill(first, slots, arena)`:
        `slots[i]` is the (offset, length) to fill for keys[first + i], or None
        when the block is already cached or was refused; then commits. The
        store half of read_slots; a `fill` that raises aborts its chunk."""
        keys = _keys(keys)
        if len(sizes) != len(keys):
            raise ArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
        if parent is not None:
            _keys([parent])
        out: list[Outcome] = []
        for i, j in self._chunks(sizes):
            part = self._write_chunk(i, keys[i:j], sizes[i:j], fill, keys[i - 1] if i else parent)
            out.extend(part)
            if part and part[-1] is not Outcome.DONE:  # the rest would lack its parent
                out.extend([Outcome.MISSING] * (len(keys) - j))
                break
        return out

    def _read_chunk(self, first: int, keys: list[bytes], sizes: Sequence[int], fill: SlotFn) -> list[Outcome]:
        try:
            leases = self._call("acquire", {"keys": keys})
            arena = self._arena
        except UcmError as exc:
            log.debug("%s", exc)
            return [Outcome.MISSING] * len(keys)
        held = [lease[0] for lease in leases if lease is not None]
        slots: list[Optional[tuple[int, int]]] = []
        out: list[Outcome] = []
        for lease, size in zip(leases, sizes):
            if lease is None:
                slots.append(None)
                out.append(Outcome.MISSING)
            elif lease[2] != size:
                slots.append(None)
                out.append(Outcome.CORRUPT)
            else:
                slots.append((lease[1], lease[2]))
                out.append(Outcome.DONE)
        try:
            if any(s is not None for s in slots):
                fill(first, slots, arena)
        except Exception:
            log.exception("ucm client: copying out of leased slots failed")
            out = [Outcome.FAILED if s is not None else o for s, o in zip(slots, out)]
        finally:
            if held:
                self._try("release", {"leases": held}, None)
        return out

    def _write_chunk(self, first: int, keys: list[bytes], sizes: Sequence[int], fill: SlotFn,
                     parent: Optional[bytes]) -> list[Outcome]:
        try:
            reply = self._call("reserve", {"keys": keys, "sizes": list(sizes), "parent": parent})
            arena = self._arena
        except UcmError as exc:
            log.debug("%s", exc)
            return [Outcome.FAILED] * len(keys)
        slots = [tuple(r) if isinstance(r, list) else None for r in reply]
        filled = [k for k, s in zip(keys, slots) if s is not None]
        out = [Outcome.MISSING if r is None else Outcome.DONE for r in reply]
        if not filled:
            return out
        try:
            fill(first, slots, arena)
        except Exception:
            log.exception("ucm client: copying into reserved slots failed")
            self._try("abort", {"keys": filled}, None)
            return [Outcome.FAILED if s is not None else o for s, o in zip(slots, out)]
        ok = self._try("commit", {"keys": filled}, None)
        failed = set(filled) if ok is None else {k for k, good in zip(filled, ok) if not good}
        return [Outcome.FAILED if k in failed else o for k, o in zip(keys, out)]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._disconnect_locked()
        self._pool.shutdown(wait=True)
        with self._index_lock:
            if self._index is not None:
                self._index.close()
                self._index = None
        if self._arena is not None:
            try:
                self._arena.close()
            except BufferError:
                pass

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- data path ---------------------------------------------------------
    def _submit(self, n: int, fn: Any, *args: Any) -> Handle:
        handle = Handle(n)

        def run() -> None:
            try:
                res = fn(*args)
            except Exception:  # never hang or raise into the engine for a cache fault
                log.exception("ucm client: %s failed", getattr(fn, "__name__", fn))
                res = [Outcome.FAILED] * n
            handle._finish(res)

        if n:
            self._pool.submit(run)
        return handle

    def _store(self, keys: list[bytes], views: list[memoryview], parent: Optional[bytes]) -> list[Outcome]:
        def fill(first: int, slots: list, arena: Any) -> None:
            m = memoryview(arena)
            for i, slot in enumerate(slots):
                if slot is not None:
                    _native.copy(m[slot[0]:slot[0] + slot[1]], views[first + i])

        return self.write_slots(keys, [len(v) for v in views], fill, parent)

    def _chunks(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Index ranges of at most 1/8 of the arena each (at least one block),
        so that one request never needs more slots than the arena has."""
        budget = max(1, int(self.service_info.get("arena_bytes", 0)) // 8)
        out, i = [], 0
        while i < len(sizes):
            j, size = i, 0
            while j < len(sizes) and (j == i or size + sizes[j] <= budget):
                size += sizes[j]
                j += 1
            out.append((i, j))
            i = j
        return out

    def _load(self, keys: list[bytes], views: list[memoryview]) -> list[Outcome]:
        def fill(first: int, slots: list, arena: Any) -> None:
            m = memoryview(arena)
            for i, slot in enumerate(slots):
                if slot is not None:
                    _native.copy(views[first + i], m[slot[0]:slot[0] + slot[1]])

        return self.read_slots(keys, [len(v) for v in views], fill)


Key = bytes
# fill(first, slots, arena): slots[i] = (offset, length) in arena, or None.
SlotFn = Callable[[int, list, Any], None]


def _keys(keys: Sequence[Key]) -> list[bytes]:
    return list(check_keys(keys))


def _views(keys: list[bytes], bufs: Sequence[Any], writable: bool) -> list[memoryview]:
    if len(keys) != len(bufs):
        raise ArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
    return [byte_view(b, writable=writable, what="destination" if writable else "source") for b in bufs]


def connect(config: Union[None, str, Mapping[str, Any], UcmConfig] = None, start: bool = True,
            timeout_s: float = 60.0, idle_exit_s: float = 5.0) -> CacheClient:
    """A client of the service for `config`. When none is running and
    `start` is true, starts a private one for this config (it exits once no
    client has used it for `idle_exit_s`)."""
    cfg = config if isinstance(config, UcmConfig) else load_config(config)
    path = socket_path(cfg)
    client = CacheClient(path, cfg)
    if client.connected or not start:
        return client
    lock_path = path + ".lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter among racing processes
        with client._lock:
            try:
                client._connect_locked()
                return client
            except ServiceUnavailable:
                pass
        fd, cfg_path = tempfile.mkstemp(prefix="ucm-private-", suffix=".yaml", dir=runtime_dir())
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f)
        log_path = os.path.join(runtime_dir(), f"{cfg.service.name}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ucm.cli", "serve", "--config", cfg_path, "--private",
                 "--idle-exit-s", str(idle_exit_s)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                cwd=runtime_dir(),  # not the caller's directory: a source tree there may shadow ucm
                env={**os.environ, "UCM_CONFIG": ""})
        client.spawned = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            with client._lock:
                try:
                    client._connect_locked()
                    break
                except ServiceUnavailable:
                    pass
            time.sleep(0.05)
        try:
            os.unlink(cfg_path)
        except OSError:
            pass
    if not client.connected:
        proc = client.spawned
        why = (f": it did not answer within {timeout_s:g} s" if proc is not None and proc.poll() is None
               else _last_error(log_path))
        log.warning("ucm: could not start a private service for %s%s (log: %s); running without a cache",
                    path, why, log_path)
    return client


def _last_error(log_path: str) -> str:
    """': <the service's last log line>' (why it did not start), or ''."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f": {lines[-1]}" if lines else ""
