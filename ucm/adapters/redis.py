"""`redis`: blocks as string values in Redis or Valkey, shared by every node.

Values. Each block is one string value `header || payload` (ucm.adapters.
framing) under the key `<key_prefix><32 hex digits of the block key>`, so
several deployments share one server by choosing different prefixes. Reads
check the header (magic, key, length, XXH3-64): foreign or damaged values are
CORRUPT, never data.

Batches. A batch is pipelined on one pooled connection: every command of a
group of up to `pipeline_bytes` bytes is sent, then every reply read. Values
are sent straight from the caller's buffer (the RESP bulk string is the
header followed by the payload, written with scatter/gather sends through
redis-py's `send_packed_command`; nothing is concatenated). `SET ... NX`
keeps a key's first value; `ttl_s` adds `PX`.

Space. `capacity_bytes` is this adapter's budget on the shared server: it
counts the values it stored (header included) and answers NO_SPACE past it;
a server out of memory (`OOM` reply under `maxmemory` with `noeviction`) is
NO_SPACE too. The server may evict or expire values on its own: a value this
adapter stored that is found gone (on `get` or `contains`) is a miss, leaves
the budget, and is reported by `drain_dropped()`.

Keys. `iter_keys()` returns the keys this instance knows: those it stored or
found already present when storing, minus those found gone. It never scans
the server (other deployments' keys are not its business, and SCAN over a
large shared keyspace is slow); `contains`, `get` and `size_of` ask the
server, so blocks stored by other nodes are found.

Faults. A refused connection, a timeout (`socket_timeout_s`) or a dropped
connection answers FAILED (reads, writes) or False/None (queries) for the
whole batch, never an exception, and for `retry_after_s` afterwards the
adapter answers at once without touching the network; then it tries again
(redis-py reconnects), so a restarted server is used again without
restarting anything. redis-py's own retries are disabled so that a dead
server costs one connection attempt, not a backoff ladder.

Range reads. Not declared (RangeReads): a value is a version-1 frame with one
checksum for the payload, which other nodes read too, so a GETRANGE of part
of it could not be verified. `read_range` serves ranges with a whole GET,
verified as a whole. Chunked frames (as fs writes) would make GETRANGE
verifiable; docs/design-notes.md, "Checksum granularity".

Thread-safe: redis-py's blocking pool hands each call its own connection;
the budget index and the circuit breaker (ucm.adapters.cluster) have their
own locks, and one lock guards the counters; none is held across network
I/O. Lock order: `_lock`, then the budget's or the breaker's.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from pydantic import Field, field_validator

from ucm import _native
from ucm.adapters import framing
from ucm.adapters.base import AdapterConfig, Key, Status
from ucm.adapters.cluster import BudgetedAdapter, CircuitBreaker, ClusterBudget
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError, ClosedError
from ucm.config.sizes import parse_size

log = logging.getLogger(__name__)

_SMALL = 64 << 10  # payloads below this are copied into one send instead of three


class RedisConfig(AdapterConfig):
    url: str  # redis://[user:password@]host:port/db, rediss://... (TLS) or unix:///path.sock?db=0
    key_prefix: str = Field(default="ucm/", min_length=1, max_length=256)
    ttl_s: Optional[float] = Field(default=None, gt=0)  # expire values after this long (PX); None: never
    socket_timeout_s: float = Field(default=2.0, gt=0)  # one reply must arrive within this
    connect_timeout_s: float = Field(default=0.5, gt=0)
    retry_after_s: float = Field(default=1.0, ge=0)  # after a failure, answer at once for this long
    max_connections: int = Field(default=8, ge=1, le=1024)
    pipeline_bytes: int = 64 << 20  # bytes of values per pipelined round trip

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with redis://, rediss:// or unix://, got {v!r}")
        return v

    @field_validator("pipeline_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        n = parse_size(v)
        if n < (1 << 20):
            raise ValueError(f"must be at least 1MiB, got {n}")
        return n


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _command(*args: bytes) -> list[bytes]:
    return [b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)]


def _commands(verb: bytes, rkeys: Sequence[bytes]) -> list[list[bytes]]:
    """`verb key` for every key, as one send."""
    return [[b"".join(_command(verb, rk)[0] for rk in rkeys)]]


class _Down(Exception):
    """The server could not be reached; the batch answers its fault value."""


class RedisAdapter(BudgetedAdapter):
    """Framed blocks in a shared Redis/Valkey server."""

    name = "redis"
    kv_medium = "EXTERNAL"
    Config = RedisConfig

    def __init__(self, capacity_bytes: int, config: RedisConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the time the circuit breaker reads (tests hold it still)."""
        self._budget = ClusterBudget("redis", capacity_bytes)  # the values this instance relies on
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise AdapterError("redis: the redis-py package is not installed (pip install redis)") from exc
        self.config = config
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._response_error = redis.exceptions.ResponseError
        try:
            self._pool = redis.BlockingConnectionPool.from_url(
                config.url, max_connections=config.max_connections, timeout=config.socket_timeout_s,
                socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.connect_timeout_s,
                socket_keepalive=True, retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except (ValueError, TypeError) as exc:
            raise AdapterError(f"redis: bad url {config.url!r}: {exc}") from exc
        self._prefix = config.key_prefix.encode()
        self._ttl = [b"PX", b"%d" % max(1, int(config.ttl_s * 1000))] if config.ttl_s else []
        self._breaker = CircuitBreaker("redis", _redacted(config.url), config.retry_after_s, clock=clock)
        self._lock = threading.Lock()  # guards _closed and _stats
        self._closed = False
        self._stats = {"bytes_in": 0, "bytes_out": 0, "hits": 0, "misses": 0, "corrupt": 0,
                       "no_space": 0, "failed": 0}
        try:
            self._roundtrip([_command(b"PING")])
        except _Down:
            log.warning("redis: %s does not answer now; the tier answers misses until it does",
                        _redacted(config.url))

    # ---- plumbing ----------------------------------------------------------
    def _rkey(self, key: Key) -> bytes:
        return self._prefix + framing.check_key(key).hex().encode()

    def _available(self) -> bool:
        with self._lock:
            if self._closed:
                raise ClosedError("redis adapter used after close()")
        return self._breaker.allows()

    def _roundtrip(self, commands: Iterable[list[Any]], on_reply: Optional[Callable[[int, Any], None]] = None,
                   replies_expected: Optional[int] = None) -> list[Any]:
        """Sends every command (a list of chunks, produced lazily so that
        building command k+1 overlaps the server reading command k), then
        reads every reply. A reply is a value or the ResponseError the server
        answered; with `on_reply`, each is handed over as it arrives (so that
        checking reply k overlaps the server sending reply k+1) instead of
        being returned. `replies_expected`: when one element of `commands`
        holds several commands."""
        try:
            conn = self._pool.get_connection()
        except self._errors as exc:
            if "No connection available" not in str(exc):  # a busy pool is not a dead server
                self._breaker.trip(exc)
            raise _Down() from exc
        replies: list[Any] = []
        try:
            sent = 0
            for cmd in commands:
                conn.send_packed_command(cmd, check_health=False)
                sent += 1
            for k in range(sent if replies_expected is None else replies_expected):
                try:
                    reply = conn.read_response()
                except self._response_error as exc:
                    reply = exc
                if on_reply is not None:
                    on_reply(k, reply)
                replies.append(reply)  # freed with the group: freeing each at once costs page faults
                del reply
        except self._errors as exc:
            conn.disconnect()
            self._pool.release(conn)
            self._breaker.trip(exc)
            raise _Down() from exc
        except BaseException:
            conn.disconnect()  # the reply stream is out of step: never reuse it
            self._pool.release(conn)
            raise
        self._pool.release(conn)
        return replies

    def _groups(self, sizes: Sequence[int]) -> Iterator[range]:
        start, acc = 0, 0
        for i, n in enumerate(sizes):
            if i > start and acc + n > self.config.pipeline_bytes:
                yield range(start, i)
                start, acc = i, 0
            acc += n
        if start < len(sizes):
            yield range(start, len(sizes))

    # ---- StorageAdapter ----------------------------------------------------
    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        views = [byte_view(b, what="blob") for b in blobs]
        rkeys = [self._rkey(k) for k in keys]
        out: list[Optional[Status]] = [None] * len(keys)
        if not self._available():
            with self._lock:
                self._stats["failed"] += len(keys)
            return [Status.FAILED] * len(keys)
        sizes = [len(v) for v in views]
        res = self._budget.reserve(keys, sizes)  # reserved; released below unless it lands
        out, todo = res.out, res.todo
        landed: dict[int, bool] = {}
        try:
            for group in self._groups([len(views[i]) for i in todo]):
                idx = [todo[g] for g in group]
                cmds = (self._set_command(keys[i], rkeys[i], views[i]) for i in idx)
                try:
                    replies = self._roundtrip(cmds)
                except _Down:
                    for i in idx:
                        out[i] = Status.FAILED
                    continue
                for i, r in zip(idx, replies):
                    if isinstance(r, Exception):
                        oom = str(r).startswith("OOM")
                        out[i] = Status.NO_SPACE if oom else Status.FAILED
                        if not oom:
                            log.warning("redis: SET refused: %s", r)
                    else:  # b"OK": stored; None: the key was there already (kept as it is)
                        out[i] = Status.OK
                        landed[i] = r is not None
        finally:
            new = self._budget.settle((keys[i], sizes[i], out[i] is Status.OK) for i in todo)
            self._count_put(out, sizes, [i for i, n in zip(todo, new) if n and landed.get(i)])
        return [s if s is not None else Status.FAILED for s in out]

    def _count_put(self, out: list[Optional[Status]], sizes: list[int], written: list[int]) -> None:
        with self._lock:
            self._stats["bytes_in"] += sum(sizes[i] for i in written)
            for s in out:
                if s is not Status.OK:
                    self._stats["no_space" if s is Status.NO_SPACE else "failed"] += 1

    def _set_command(self, key: Key, rkey: bytes, payload: memoryview) -> list[Any]:
        header = framing.pack_header(key, payload)
        n = len(payload)
        head = b"*%d\r\n" % (4 + len(self._ttl)) + _bulk(b"SET") + _bulk(rkey) + b"$%d\r\n" % (len(header) + n) + header
        tail = b"\r\n" + _bulk(b"NX") + b"".join(_bulk(a) for a in self._ttl)
        if n < _SMALL:
            return [head + bytes(payload) + tail]
        return [head, payload, tail]

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        rkeys = [self._rkey(k) for k in keys]
        out: list[Status] = [Status.FAILED] * len(keys)
        if not self._available():
            with self._lock:
                self._stats["failed"] += len(keys)
            return out

        def place(i: int, r: Any) -> None:
            if isinstance(r, Exception):  # e.g. WRONGTYPE: not a value of ours
                out[i] = Status.CORRUPT
            elif r is None:
                out[i] = Status.NOT_FOUND
            else:
                out[i] = framing.verify_frame(keys[i], r, len(views[i]))
                if out[i] is Status.OK:
                    _native.copy(views[i], memoryview(r)[framing.HEADER_BYTES:])

        for group in self._groups([len(v) for v in views]):
            idx = list(group)
            try:
                self._roundtrip(_commands(b"GET", [rkeys[i] for i in idx]), lambda k, r: place(idx[k], r),
                                replies_expected=len(idx))
            except _Down:
                for i in idx:
                    out[i] = Status.FAILED
        self._budget.gone(k for k, s in zip(keys, out) if s is Status.NOT_FOUND)
        with self._lock:
            for v, s in zip(views, out):
                if s is Status.OK:
                    self._stats["hits"] += 1
                    self._stats["bytes_out"] += len(v)
                elif s is Status.NOT_FOUND:
                    self._stats["misses"] += 1
                elif s is Status.CORRUPT:
                    self._stats["corrupt"] += 1
                else:
                    self._stats["failed"] += 1
        return out

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            replies = self._roundtrip(_commands(b"EXISTS", rkeys), replies_expected=len(rkeys))
        except _Down:
            return [False] * len(keys)
        out = [r == 1 for r in replies]
        self._budget.gone(k for k, present in zip(keys, out) if not present)
        return out

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            replies = self._roundtrip(_commands(b"UNLINK", rkeys), replies_expected=len(rkeys))
        except _Down:
            return [False] * len(keys)
        self._budget.forget(keys)
        return [r == 1 for r in replies]

    def size_of(self, key: Key) -> Optional[int]:
        rkey = self._rkey(key)
        if not self._available():
            return None
        try:
            (n,) = self._roundtrip([_command(b"STRLEN", rkey)])
        except _Down:
            return None
        if isinstance(n, Exception) or not n or n < framing.HEADER_BYTES:
            if n == 0:
                self._budget.gone([key])
            return None
        return n - framing.HEADER_BYTES

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = dict(self._stats)
        return dict(out, **self._budget.stats(), outages=self._breaker.outages,
                    refused_calls=self._breaker.refused, url=_redacted(self.config.url),
                    down=self._breaker.down)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.disconnect()


def _redacted(url: str) -> str:
    """The URL without its password, for logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
