"""Fault injection at the seams, in the manner of CacheLib's fault-injecting
device: a wrapper around a real device or a real adapter that fails,
corrupts or delays the calls it is told to, and passes the rest through.

- `FaultyDevice` wraps the positional I/O engine an `nvme` adapter is built
  with (`NvmeAdapter(..., device=FaultyDevice(_native.IoEngine(n)))`): reads
  or writes that return `-errno`, reads whose bytes are flipped after they
  arrived, a hook run before each call (to interleave threads
  deterministically).
- `FaultyAdapter` wraps any StorageAdapter (`UnifiedCache(config,
  tier_factory=...)` builds the tiers through it): per operation, a Status
  per key instead of the real call, or an exception raised from it. Over a
  tier with shared-memory slots (`dram`) the slot calls (`reserve`,
  `commit`, `abort`, `lease`, `release`) may raise too. Every other
  attribute (its `segment_path`) is the wrapped adapter's.

Neither is registered as an entry point: they are built in code, by tests
and by `ucm bench soak`. Thread-safe: the rules are taken under a lock; the
wrapped calls run outside it.
"""
from __future__ import annotations

import errno as _errno
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from ucm.adapters.base import BlockEntry, Key, Lease, SharedSlots, SlotVictims, Status, StorageAdapter
from ucm.errors import ArgumentError


@dataclass
class _Rule:
    action: str  # "errno" | "corrupt" | "status" | "raise"
    times: Optional[int]  # None: until cleared
    value: Any = None

    def take(self) -> bool:
        """True while the rule applies (counts one use)."""
        if self.times is None:
            return True
        if self.times <= 0:
            return False
        self.times -= 1
        return True


class _Rules:
    def __init__(self, ops: Sequence[str]) -> None:
        self._ops = tuple(ops)
        self._lock = threading.Lock()
        self._rules: dict[str, list[_Rule]] = {op: [] for op in ops}
        self.calls: dict[str, int] = {op: 0 for op in ops}

    def add(self, op: str, rule: _Rule) -> None:
        if op not in self._rules:
            raise ArgumentError(f"fault injection: unknown operation {op!r}; known: {list(self._ops)}")
        if rule.times is not None and (not isinstance(rule.times, int) or rule.times < 1):
            raise ArgumentError(f"fault injection: times must be a positive int or None, got {rule.times!r}")
        with self._lock:
            self._rules[op].append(rule)

    def take(self, op: str) -> Optional[_Rule]:
        with self._lock:
            self.calls[op] += 1
            rules = self._rules[op]
            while rules:
                if rules[0].take():
                    return rules[0]
                rules.pop(0)
            return None

    def clear(self) -> None:
        with self._lock:
            for rules in self._rules.values():
                rules.clear()


class FaultyDevice:
    """A positional I/O engine (`read_batch` / `write_batch` returning bytes
    moved or `-errno` per request) that fails or corrupts on demand."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._rules = _Rules(("read", "write"))
        self.before: Optional[Callable[[str], None]] = None  # called before each read/write

    @property
    def calls(self) -> dict[str, int]:
        return dict(self._rules.calls)

    def __getattr__(self, name: str) -> Any:  # anything else the engine has (threads, ...)
        return getattr(self.inner, name)

    def fail_writes(self, err: int = _errno.ENOSPC, times: Optional[int] = None) -> None:
        """The next `times` write calls (every one for None) fail with -err."""
        self._rules.add("write", _Rule("errno", times, err))

    def fail_reads(self, err: int = _errno.EIO, times: Optional[int] = None) -> None:
        self._rules.add("read", _Rule("errno", times, err))

    def corrupt_reads(self, times: Optional[int] = None) -> None:
        """The next `times` read calls succeed, then one byte of every buffer
        they filled is flipped (bit rot the checksum must catch)."""
        self._rules.add("read", _Rule("corrupt", times))

    def clear(self) -> None:
        self._rules.clear()

    def read_batch(self, fd: int, bufs: Sequence[Any], offsets: Sequence[int]) -> list[int]:
        if self.before is not None:
            self.before("read")
        rule = self._rules.take("read")
        if rule is not None and rule.action == "errno":
            return [-rule.value] * len(bufs)
        res = self.inner.read_batch(fd, bufs, offsets)
        if rule is not None and rule.action == "corrupt":
            for buf, n in zip(bufs, res):
                if n > 0:
                    view = memoryview(buf).cast("B")
                    view[n // 2] ^= 0x40
        return res

    def write_batch(self, fd: int, bufs: Sequence[Any], offsets: Sequence[int]) -> list[int]:
        if self.before is not None:
            self.before("write")
        rule = self._rules.take("write")
        if rule is not None and rule.action == "errno":
            return [-rule.value] * len(bufs)
        return self.inner.write_batch(fd, bufs, offsets)


class FaultyAdapter(StorageAdapter):
    """A StorageAdapter that answers chosen operations with a fault. Over a
    tier that declares SharedSlots it declares them too (the slot calls go
    to the wrapped adapter untouched), so the cache and the service see the
    same abilities through the wrapper."""

    OPS = ("put", "get", "contains", "delete", "size_of")

    def __new__(cls, inner: StorageAdapter) -> "FaultyAdapter":
        if cls is FaultyAdapter and isinstance(inner, SharedSlots):
            cls = FaultySharedSlots
        return super().__new__(cls)

    def __init__(self, inner: StorageAdapter) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.Config = inner.Config  # type: ignore[misc]
        self.shared = inner.shared  # type: ignore[misc]
        self._rules = _Rules(self.OPS)

    @property
    def calls(self) -> dict[str, int]:
        return dict(self._rules.calls)

    def fail(self, op: str, status: Status = Status.FAILED, times: Optional[int] = None) -> None:
        """`put` / `get` answer `status` for every key instead of running."""
        if op not in ("put", "get"):
            raise ArgumentError(f"fault injection: fail() takes 'put' or 'get', got {op!r}")
        self._rules.add(op, _Rule("status", times, status))

    def raise_on(self, op: str, exc: BaseException, times: Optional[int] = None) -> None:
        """`op` raises `exc` instead of running (a bug or a dead device)."""
        self._rules.add(op, _Rule("raise", times, exc))

    def clear(self) -> None:
        self._rules.clear()

    def _fault(self, op: str, n: int) -> Optional[list[Status]]:
        rule = self._rules.take(op)
        if rule is None:
            return None
        if rule.action == "raise":
            raise rule.value
        return [rule.value] * n

    def __getattr__(self, name: str) -> Any:  # the wrapped adapter's other abilities
        return getattr(self.inner, name)

    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        faulted = self._fault("put", len(keys))
        return faulted if faulted is not None else self.inner.put(keys, blobs)

    def put_with_parents(self, keys: Sequence[Key], blobs: Sequence[Any],
                         parents: Sequence[Optional[Key]]) -> list[Status]:
        faulted = self._fault("put", len(keys))
        return faulted if faulted is not None else self.inner.put_with_parents(keys, blobs, parents)

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        faulted = self._fault("get", len(keys))
        return faulted if faulted is not None else self.inner.get(keys, dsts)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        self._fault("contains", len(keys))
        return self.inner.contains(keys)

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        self._fault("delete", len(keys))
        return self.inner.delete(keys)

    def size_of(self, key: Key) -> Optional[int]:
        self._fault("size_of", 1)
        return self.inner.size_of(key)

    def iter_keys(self) -> Iterator[Key]:
        return self.inner.iter_keys()

    def iter_entries(self) -> Iterator[BlockEntry]:
        return self.inner.iter_entries()

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def footprint_bytes(self, size: int) -> int:
        return self.inner.footprint_bytes(size)

    def flush(self, timeout_s: float = 60.0) -> bool:
        return self.inner.flush(timeout_s=timeout_s)

    def drain_dropped(self) -> list[Key]:
        return self.inner.drain_dropped()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class FaultySharedSlots(FaultyAdapter, SharedSlots):
    """FaultyAdapter over a SharedSlots tier (built by FaultyAdapter(inner)).
    `raise_on` also takes the slot calls: a `release` that raises has not
    given the lease back (a broken arena), as a real one would not have."""

    OPS = FaultyAdapter.OPS + ("reserve", "commit", "abort", "lease", "release")

    def reserve(self, key: Key, size: int) -> Optional[memoryview]:
        self._fault("reserve", 1)
        return self.inner.reserve(key, size)

    def commit(self, key: Key) -> bool:
        self._fault("commit", 1)
        return self.inner.commit(key)

    def abort(self, key: Key) -> None:
        self._fault("abort", 1)
        self.inner.abort(key)

    def lease(self, key: Key) -> Optional[Lease]:
        self._fault("lease", 1)
        return self.inner.lease(key)

    def release(self, lease: Lease) -> None:
        self._fault("release", 1)
        self.inner.release(lease)

    def slot_offset(self, key: Key) -> Optional[tuple[int, int]]:
        return self.inner.slot_offset(key)

    @property
    def segment_path(self) -> str:
        return self.inner.segment_path

    def segment_view(self) -> memoryview:
        return self.inner.segment_view()

    def victims_for(self, size: int, acceptable: Optional[Callable[[tuple[Key, ...]], bool]] = None) -> SlotVictims:
        return self.inner.victims_for(size, acceptable)
