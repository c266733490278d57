"""`fs`: one file per block on a file system mounted on every node.

For shared file systems (NFS, 3FS, Lustre, CephFS, or a local directory for
one node): every node configures the same `path`, and a block stored by one
node is found and loaded by the others.

Layout. `<path>/<key_prefix>/<aa>/<bb>/<32 hex digits>.v2`: the first bytes
of the key name `shard_levels` levels of 256 directories each, so no
directory grows large. A file is a chunked frame (ucm.adapters.framing,
version 2): `header || chunk table || payload`, an XXH3-64 per 32 KiB chunk
of the payload. Reads check magic, key, length, the table's checksum and
every chunk they return, so a damaged, truncated or foreign file is CORRUPT,
never data. Files of the earlier layout (`<32 hex digits>`, one checksum
per file) are neither read nor removed: a node of this version misses them,
and a node of the earlier version misses these, so that nodes of both
versions on one tree never take each other's files for corrupt.

Range reads (`get_range`, RangeReads) read the header and table, then only
the chunks that cover the range, and verify those: a bad chunk is CORRUPT
for that read (as for `get`, the owner forgets the block), while a range
that does not touch it still verifies.

Writes are atomic for readers: a block is written to a temporary name beside
its final name (`.<hex>.<host>.<pid>.<n>.tmp`), optionally fsync'ed, then
renamed into place. A reader on any node sees no file or the whole block.
A key already present is left as it is. Temporaries left by a crashed writer
are removed by the next scan once older than `tmp_max_age_s`.

I/O. Batches run on a pool of `io_threads` threads: each item is an open,
one scatter/gather `readv`/`writev` of header and payload (straight into or
out of the caller's buffer, no staging copy), and a close; the blocking
calls and the checksums release the GIL, so a batch has many files in
flight. (This is what aiofiles does under asyncio, minus the event loop.)

Space. The adapter keeps an index key -> (payload bytes), in least recently
used order, and the bytes it accounts for. It is built by one scan of the
tree at start (`scan_on_start`) and, if `rescan_interval_s` > 0, refreshed by
a background scan that picks up other nodes' blocks and deletions; in
between it learns from its own writes and from files it finds present or
missing on lookups. A write never scans: it checks the accounted bytes and,
when the new block does not fit in `capacity_bytes`, removes the least
recently used indexed files first (`on_full: evict`, for a pool shared by
nodes whose caches each only know their own blocks), or answers NO_SPACE
(`on_full: refuse`). Every removal and every indexed file found gone is
reported by `drain_dropped()`. `iter_keys()` returns the index.

The index is a `ClusterBudget` (ucm.adapters.cluster), as in the other
cluster tiers.

Faults. ENOSPC and EDQUOT are NO_SPACE; other I/O errors are FAILED;
neither raises. Thread-safe: the budget has its own lock and one lock guards
the counters, neither held across I/O (lock order: `_lock`, then the
budget's); concurrent writers of one key race harmlessly (same bytes, atomic
renames).
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, Optional, Sequence

from pydantic import Field, field_validator

from ucm.adapters import framing
from ucm.adapters.base import AdapterConfig, Key, RangeReads, Status, check_range_args
from ucm.adapters.cluster import BudgetedAdapter, ClusterBudget
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError, ClosedError

log = logging.getLogger(__name__)

_SUFFIX = ".v2"  # files of the chunked layout (framing version 2)
_NAME = re.compile(r"^[0-9a-f]{32}\.v2$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class FsConfig(AdapterConfig):
    path: str  # the shared mount point (or any directory)
    # A subdirectory of `path`, one per deployment (not "." or "..").
    key_prefix: str = Field(default="ucm", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    shard_levels: int = Field(default=2, ge=0, le=3)  # directory levels of 256 entries
    io_threads: int = Field(default=8, ge=1, le=256)
    fsync: bool = False  # fsync each block before it is renamed into place (durability across crashes)
    file_mode: int = Field(default=0o600, ge=0, le=0o777)  # of block files; 0o640/0o644 to share between users
    on_full: Literal["evict", "refuse"] = "evict"
    scan_on_start: bool = True  # index the blocks already in the tree
    rescan_interval_s: float = Field(default=0.0, ge=0.0)  # 0: never rescan in the background
    tmp_max_age_s: float = Field(default=3600.0, gt=0.0)

    @field_validator("key_prefix")
    @classmethod
    def _one_directory_down(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError(f"must name a subdirectory of path, not {v!r}")
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v:
            raise ValueError("must name a directory")
        return v


class FsAdapter(BudgetedAdapter, RangeReads):
    """Blocks as files in a sharded tree on a (shared) file system."""

    name = "fs"
    kv_medium = "DISK"
    Config = FsConfig

    def __init__(self, capacity_bytes: int, config: FsConfig) -> None:
        self.config = config
        # key -> payload bytes, LRU first; a put of a key being written answers OK (same bytes)
        self._budget = ClusterBudget("fs", capacity_bytes, pending_is_held=True,
                                     footprint=lambda n: framing.chunked_header_bytes(n) + n)
        self.root = os.path.join(os.path.abspath(config.path), config.key_prefix)
        # directories are searchable by whoever may read the files
        self._dir_mode = 0o700 | (0o050 if config.file_mode & 0o040 else 0) | (0o005 if config.file_mode & 0o004 else 0)
        try:
            os.makedirs(self.root, mode=self._dir_mode, exist_ok=True)
        except OSError as exc:
            raise AdapterError(f"fs: cannot create {self.root!r}: {exc}") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise AdapterError(f"fs: {self.root!r} is not readable and writable by this user")
        self._lock = threading.Lock()  # guards _stats
        self._dirs: set[str] = set()
        self._tmp_tag = f"{socket.gethostname()}.{os.getpid()}"
        self._tmp_seq = itertools.count()
        self._closed = False
        self._stats = {"bytes_in": 0, "bytes_out": 0, "hits": 0, "range_hits": 0, "misses": 0, "corrupt": 0,
                       "no_space": 0, "failed": 0, "scans": 0, "tmp_removed": 0}
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="ucm-fs")
        if config.scan_on_start:
            self.rescan()
        self._stop = threading.Event()
        self._scanner: Optional[threading.Thread] = None
        if config.rescan_interval_s > 0:
            self._scanner = threading.Thread(target=self._scan_loop, name="ucm-fs-scan", daemon=True)
            self._scanner.start()

    # ---- paths -------------------------------------------------------------
    def _dir(self, hexkey: str) -> str:
        parts = [hexkey[2 * i:2 * i + 2] for i in range(self.config.shard_levels)]
        return os.path.join(self.root, *parts)

    def path_of(self, key: Key) -> str:
        """The file a block lives in (whether or not it exists)."""
        h = framing.check_key(key).hex()
        return os.path.join(self._dir(h), h + _SUFFIX)

    # ---- batches -----------------------------------------------------------
    def _map(self, fn: Callable[[int], Any], n: int) -> list[Any]:
        if n <= 1:
            return [fn(i) for i in range(n)]
        return list(self._pool.map(fn, range(n)))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("fs adapter used after close()")

    # ---- write path --------------------------------------------------------
    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        views = [byte_view(b, what="blob") for b in blobs]
        paths = [self.path_of(k) for k in keys]
        sizes = [len(v) for v in views]
        self._check_open()
        res = self._budget.reserve(keys, sizes, evict=self.config.on_full == "evict")
        out, todo, victims = res.out, res.todo, res.victims
        if victims:
            self._map(lambda j: _unlink(self.path_of(victims[j])), len(victims))
            self._budget.evicted(victims)

        def write(j: int) -> Status:
            i = todo[j]
            return self._write_one(keys[i], paths[i], views[i])

        try:
            for i, st in zip(todo, self._map(write, len(todo))):
                out[i] = st
        finally:
            new = self._budget.settle((keys[i], sizes[i], out[i] is Status.OK) for i in todo)
        with self._lock:
            self._stats["bytes_in"] += sum(sizes[i] for i, n in zip(todo, new) if n)
            for st in out:
                if st is not Status.OK:
                    self._stats["no_space" if st is Status.NO_SPACE else "failed"] += 1
        return [s if s is not None else Status.FAILED for s in out]

    def _write_one(self, key: Key, path: str, payload: memoryview) -> Status:
        if os.path.exists(path):  # stored meanwhile by another node: blobs under a key never change
            return Status.OK
        d = os.path.dirname(path)
        tmp = os.path.join(d, f".{os.path.basename(path)}.{self._tmp_tag}.{next(self._tmp_seq)}.tmp")
        header = framing.pack_chunked_header(key, payload)
        try:
            if d not in self._dirs:
                os.makedirs(d, mode=self._dir_mode, exist_ok=True)
                self._dirs.add(d)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.config.file_mode)
        except OSError as exc:
            return self._io_fault("create", tmp, exc)
        try:
            try:
                _write_all(fd, [header, payload])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            return self._io_fault("write", path, exc)
        return Status.OK

    def _io_fault(self, what: str, path: str, exc: OSError) -> Status:
        if exc.errno in _NO_SPACE:
            return Status.NO_SPACE
        log.warning("fs: %s %s failed: %s", what, path, exc)
        return Status.FAILED

    # ---- read path ---------------------------------------------------------
    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        paths = [self.path_of(k) for k in keys]
        self._check_open()
        out = self._map(lambda i: self._read_one(keys[i], paths[i], views[i]), len(keys))
        for key, v, st in zip(keys, views, out):
            if st is Status.OK:
                self._budget.touch(key, len(v))
        self._budget.gone(k for k, st in zip(keys, out) if st is Status.NOT_FOUND)
        self._count_reads(views, out, "hits")
        return out

    def _read_one(self, key: Key, path: str, dst: memoryview) -> Status:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return Status.NOT_FOUND
        except OSError as exc:
            return self._io_fault("open", path, exc)
        header = bytearray(framing.chunked_header_bytes(len(dst)))
        try:
            n = _read_all(fd, [memoryview(header), dst])
        except OSError as exc:
            return self._io_fault("read", path, exc)
        finally:
            os.close(fd)
        if n != len(header) + len(dst):
            return Status.CORRUPT
        return framing.verify_chunked(key, header, dst)

    # ---- RangeReads --------------------------------------------------------
    def get_range(self, keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[Any]) -> list[Status]:
        """Copies bytes [offsets[i], offsets[i] + len(dsts[i])) of each block
        into dsts[i], reading the file's header and chunk table and then only
        the chunks that cover the range, verified before they are copied
        (on CORRUPT the destination is left alone). An empty range inside
        the blob is OK (the header is still read and checked)."""
        check_range_args(keys, offsets, dsts)
        views = [byte_view(d, writable=True, what="destination") for d in dsts]
        paths = [self.path_of(k) for k in keys]
        self._check_open()
        res = self._map(lambda i: self._read_range(keys[i], paths[i], offsets[i], views[i]), len(keys))
        out = [st for st, _ in res]
        for key, (st, size) in zip(keys, res):
            if st is Status.OK:
                self._budget.touch(key, size)
        self._budget.gone(k for k, st in zip(keys, out) if st is Status.NOT_FOUND)
        self._count_reads(views, out, "range_hits")
        return out

    def _count_reads(self, views: Sequence[Any], out: Sequence[Status], hit: str) -> None:
        """The read counters of one batch (`hit`: the counter of an OK read)."""
        with self._lock:
            for v, st in zip(views, out):
                if st is Status.OK:
                    self._stats[hit] += 1
                    self._stats["bytes_out"] += len(v)
                elif st is Status.NOT_FOUND:
                    self._stats["misses"] += 1
                else:
                    self._stats["corrupt" if st is Status.CORRUPT else "failed"] += 1

    def _read_range(self, key: Key, path: str, offset: int, dst: memoryview) -> tuple[Status, int]:
        """(status, payload bytes of the file) of one range read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return Status.NOT_FOUND, 0
        except OSError as exc:
            return self._io_fault("open", path, exc), 0
        try:
            length = framing.chunked_payload_bytes(os.fstat(fd).st_size)
            if length is None or offset + len(dst) > length:
                return Status.CORRUPT, 0
            header = bytearray(framing.chunked_header_bytes(length))
            if _pread_all(fd, memoryview(header), 0) != len(header):
                return Status.CORRUPT, 0
            if not dst:
                return framing.verify_chunked_span(key, header, length, 0, b""), length
            start, end = framing.chunked_span(offset, len(dst), length)
            span = bytearray(end - start)
            if _pread_all(fd, memoryview(span), len(header) + start) != len(span):
                return Status.CORRUPT, 0
        except OSError as exc:
            return self._io_fault("read", path, exc), 0
        finally:
            os.close(fd)
        st = framing.verify_chunked_span(key, header, length, start, span)
        if st is Status.OK:
            dst[:] = memoryview(span)[offset - start:offset - start + len(dst)]
        return st, length

    # ---- index upkeep ------------------------------------------------------
    def rescan(self) -> None:
        """Rebuilds the index from the tree (one walk, no payload reads) and
        removes stale temporaries. Blocks found gone are reported dropped."""
        found: dict[Key, tuple[float, int]] = {}
        now = time.time()
        removed = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                full = os.path.join(dirpath, name)
                if name.endswith(".tmp"):
                    try:
                        if now - os.stat(full).st_mtime > self.config.tmp_max_age_s:
                            os.unlink(full)
                            removed += 1
                    except OSError:
                        pass
                    continue
                if not _NAME.match(name):
                    continue
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                size = framing.chunked_payload_bytes(st.st_size)
                if size is not None:
                    found[bytes.fromhex(name[:32])] = (st.st_mtime, size)
        self._budget.resync((k, size) for k, (_, size) in sorted(found.items(), key=lambda kv: kv[1][0]))
        with self._lock:
            self._stats["scans"] += 1
            self._stats["tmp_removed"] += removed
        log.info("fs: indexed %d blocks under %s", len(found), self.root)

    def _scan_loop(self) -> None:
        while not self._stop.wait(self.config.rescan_interval_s):
            try:
                self.rescan()
            except Exception:  # a flaky mount must not kill the scanner
                log.exception("fs: background scan of %s failed", self.root)

    # ---- the rest of the contract ------------------------------------------
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        paths = [self.path_of(k) for k in keys]
        self._check_open()
        sizes = self._map(lambda i: _payload_size(paths[i]), len(keys))
        for key, size in zip(keys, sizes):
            if size is not None:
                self._budget.learn(key, size)
        self._budget.gone(k for k, size in zip(keys, sizes) if size is None)
        return [s is not None for s in sizes]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        first = list(dict.fromkeys(keys))  # a key named twice is removed once: True for its first
        paths = [self.path_of(k) for k in first]
        self._check_open()
        removed = dict(zip(first, self._map(lambda i: _unlink(paths[i]), len(first))))
        self._budget.forget(first)
        return [removed.pop(k, False) for k in keys]

    def size_of(self, key: Key) -> Optional[int]:
        size = self._budget.size_of(key)
        return size if size is not None else _payload_size(self.path_of(key))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = dict(self._stats)
        return dict(out, **self._budget.stats(), root=self.root)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._scanner is not None:
            self._scanner.join(timeout=5.0)
        self._pool.shutdown(wait=True)


def _payload_size(path: str) -> Optional[int]:
    try:
        n = os.stat(path).st_size
    except OSError:
        return None
    return framing.chunked_payload_bytes(n)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("fs: cannot remove %s: %s", path, exc)
        return False


def _write_all(fd: int, bufs: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _pread_all(fd: int, buf: memoryview, offset: int) -> int:
    """Fills `buf` from `offset` of the file; returns the bytes read (less at end of file)."""
    total = 0
    while total < len(buf):
        n = os.preadv(fd, [buf[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def _read_all(fd: int, bufs: list[memoryview]) -> int:
    """Fills the buffers in order; returns the bytes read (less at end of file)."""
    views = [b for b in bufs if len(b)]
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total
