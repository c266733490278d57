"""The one cache API: its value types, its argument checks and `CacheAPI`.

`UnifiedCache` (in-process) and `CacheClient` (the same cache across the
process boundary, in `ucm serve`) both implement `CacheAPI`, and connectors
accept any `CacheAPI`. One conformance suite (tests/integration/
test_api_conformance.py) runs over both.

Faults are values: a miss, a refusal, a bad checksum or a dead service is an
`Outcome` per block, or 0 from `lookup`. Only misuse raises, with the typed
errors of `ucm.errors` (`ArgumentError`; `ClosedError` after `close`).

Requests. The placement policy's clock ticks once per request. A caller
that knows the request (an engine's scheduler) calls `begin_request` once
with the prompt's keys and passes the same `request_id` to the data-plane
calls of that request (chunked saves, a separate load), which then count
no new access; a call without a `request_id`, or with one never begun, is
one request of its own.

This module imports nothing of the cache, the service or an engine: a
worker process that only talks to the service loads it and the client.
"""
from __future__ import annotations

import enum
import logging
import threading
from concurrent.futures import BrokenExecutor, Executor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from ucm.buffers import byte_view
from ucm.errors import ArgumentError, ClosedError

log = logging.getLogger(__name__)

Key = bytes

# fill(first, slots, arena): slots[i] is the (offset, length) in `arena` (a
# writable buffer) of keys[first + i], or None where there is nothing to copy.
SlotFn = Callable[[int, list, Any], None]


class Outcome(enum.Enum):
    DONE = "done"
    MISSING = "missing"  # not cached (or refused: no room, not admitted)
    CORRUPT = "corrupt"  # bytes came back bad; the block was dropped
    FAILED = "failed"  # I/O error or a dead medium or service


@dataclass(frozen=True, slots=True)
class RangeRead:
    """What `read_ranges` did for one block: its outcome, the tier that
    served its ranges (None when none did) and the bytes delivered into
    the caller's ranges."""

    outcome: Outcome
    tier: Optional[str] = None
    bytes: int = 0


class Handle:
    """Completion of one batched operation: one Outcome per block. Made by
    an implementation of CacheAPI, completed once with `resolve`."""

    def __init__(self, n: int) -> None:
        self._results: list[Optional[Outcome]] = [None] * n
        self._event = threading.Event()
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()
        if n == 0:
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> Optional[list[Outcome]]:
        """The outcomes once done; None if `timeout_s` passed first."""
        if not self._event.wait(timeout_s):
            return None
        return list(self._results)  # type: ignore[arg-type]

    @property
    def results(self) -> list[Optional[Outcome]]:
        """Outcomes so far (None for blocks still pending)."""
        return list(self._results)

    @property
    def ok(self) -> bool:
        return self.done() and all(r is Outcome.DONE for r in self._results)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Calls `fn(handle)` once the handle is done: at once (on this
        thread) if it is done already, else on the thread that completes
        it. An exception from `fn` is logged, never raised there."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def resolve(self, results: Sequence[Outcome]) -> None:
        """Completes the handle (the implementation's side; called once)."""
        if len(results) != len(self._results):
            raise ArgumentError(f"a handle for {len(self._results)} blocks resolved with {len(results)} outcomes")
        with self._lock:
            self._results = list(results)
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _run_callback(fn, self)


def _run_callback(fn: Callable[[Handle], None], handle: Handle) -> None:
    try:
        fn(handle)
    except Exception:
        log.exception("ucm: a handle's done callback raised")


def submit(pool: Executor, n: int, fn: Callable[..., Sequence[Outcome]], *args: Any,
           on_error: Callable[[BaseException], None] = lambda exc: None) -> Handle:
    """Runs `fn(*args)` (returning n Outcomes) on `pool` and returns the
    Handle it completes. A bug that raises must not hang the caller: the
    handle then reports FAILED for every block, after `on_error(exc)`.
    Raises ClosedError when the pool was shut down (the owner closed while
    this call was on its way in)."""
    handle = Handle(n)

    def run() -> None:
        try:
            results = list(fn(*args))
            if len(results) != n:
                raise ArgumentError(f"{getattr(fn, '__name__', fn)} returned {len(results)} outcomes for {n} blocks")
        except Exception as exc:
            on_error(exc)
            results = [Outcome.FAILED] * n
        handle.resolve(results)

    if n:
        try:
            pool.submit(run)
        except BrokenExecutor:
            raise
        except RuntimeError as exc:  # the only other RuntimeError of Executor.submit: after shutdown
            raise ClosedError(f"a call raced close(): its pool is shut down ({exc})") from exc
    return handle


# ---- argument checks (shared by every implementation) -----------------------
def check_keys(keys: Any) -> list[Key]:
    """`keys` as a list of 16-byte block keys, else ArgumentError (a single
    key passed where a sequence belongs is the usual slip)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise ArgumentError(f"keys must be a sequence of 16-byte bytes objects, got one "
                            f"{type(keys).__name__} object; wrap a single key in a list")
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or len(k) != 16:
            raise ArgumentError(f"keys must be 16-byte bytes objects, got {k!r:.40}")
    return keys


def check_parent(parent: Any) -> Optional[Key]:
    """The parent of a run's first block: None or one 16-byte key."""
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != 16):
        raise ArgumentError(f"parent must be None or a 16-byte bytes object, got {parent!r:.40}")
    return parent


def check_sizes(keys: Sequence[Key], sizes: Any) -> list[int]:
    """One block size (an int > 0) per key."""
    sizes = list(sizes)
    if len(sizes) != len(keys):
        raise ArgumentError(f"{len(keys)} keys but {len(sizes)} sizes")
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            raise ArgumentError(f"sizes must be integers > 0, got {s!r}")
    return sizes


def cut_parts(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Index ranges [i, j) of consecutive blocks whose sizes add up to at
    most `budget` bytes, at least one block each: the parts a slot read or
    write is cut into (the service's client, UnifiedCache.read_slots)."""
    out, i = [], 0
    while i < len(sizes):
        j, size = i, 0
        while j < len(sizes) and (j == i or size + sizes[j] <= budget):
            size += sizes[j]
            j += 1
        out.append((i, j))
        i = j
    return out


def check_ranges(keys: Sequence[Key], offsets: Any, dsts: Any) -> tuple[list[list[int]], list[list[memoryview]]]:
    """`read_ranges`' arguments: per key a list of offsets (ints >= 0) and
    a list of as many writable destinations (their lengths are the ranges'
    lengths); returns the offsets as lists and the destinations as byte
    views."""
    offsets, dsts = list(offsets), list(dsts)
    if len(offsets) != len(keys) or len(dsts) != len(keys):
        raise ArgumentError(f"read_ranges: {len(keys)} keys but {len(offsets)} offset lists and {len(dsts)} "
                            f"destination lists")
    views, offset_lists = [], []
    for i, (offs, ds) in enumerate(zip(offsets, dsts)):
        offs, ds = list(offs), list(ds)
        offset_lists.append(offs)
        if len(offs) != len(ds):
            raise ArgumentError(f"read_ranges: block {i} has {len(offs)} offsets but {len(ds)} destinations")
        for o in offs:
            if not isinstance(o, int) or isinstance(o, bool) or o < 0:
                raise ArgumentError(f"read_ranges: offsets must be integers >= 0, got {o!r}")
        views.append([byte_view(d, writable=True, what="read_ranges destination") for d in ds])
    return offset_lists, views


# A described block's request context (ucm.cache.catalog): what its engine
# hashes the block with besides the tokens, as strings.
EXTRA_FIELDS = frozenset({"cache_salt", "lora_name", "lora_path"})
MAX_BLOCK_TOKENS = 1 << 16  # tokens in one described block


def check_blocks(blocks: Any) -> list[tuple[Key, Optional[Key], bytes, Optional[dict]]]:
    """`blocks` as [(key, parent, tokens, extra)]: 16-byte keys, a 16-byte
    parent or None, tokens as little-endian uint32 bytes (1 to 65536 of
    them), extra None or a map of EXTRA_FIELDS to strings."""
    if not isinstance(blocks, (list, tuple)):
        raise ArgumentError(f"blocks must be a list of [key, parent, tokens, extra], got {type(blocks).__name__}")
    out = []
    for b in blocks:
        if not isinstance(b, (list, tuple)) or len(b) != 4:
            raise ArgumentError("each block must be [key, parent, tokens, extra]")
        key, parent, tokens, extra = b
        if not isinstance(key, (bytes, bytearray)) or len(key) != 16:
            raise ArgumentError("a block's key must be 16 bytes")
        if parent is not None and (not isinstance(parent, (bytes, bytearray)) or len(parent) != 16):
            raise ArgumentError("a block's parent must be 16 bytes or None")
        if (not isinstance(tokens, (bytes, bytearray)) or not tokens or len(tokens) % 4
                or len(tokens) > 4 * MAX_BLOCK_TOKENS):
            raise ArgumentError(f"a block's tokens must be 1 to {MAX_BLOCK_TOKENS} little-endian uint32 values")
        if extra is not None:
            if (not isinstance(extra, Mapping) or not set(extra) <= EXTRA_FIELDS
                    or not all(isinstance(v, str) and len(v) <= 4096 for v in extra.values())):
                raise ArgumentError(f"a block's extra must map some of {sorted(EXTRA_FIELDS)} to strings")
            extra = dict(extra) or None
        out.append((bytes(key), None if parent is None else bytes(parent), bytes(tokens), extra))
    return out


def check_output_tokens(value: Any) -> int:
    """`finish`'s output_tokens: an int >= 0, else ArgumentError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ArgumentError(f"finish: output_tokens must be an integer >= 0, got {value!r}")
    return value


def check_timeout(value: Any, what: str = "timeout_s") -> float:
    """A timeout in seconds: a number in (0, 3600]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise ArgumentError(f"{what} must be a number of seconds in (0, 3600], got {value!r}")
    return float(value)


def check_request_id(value: Any) -> Optional[str]:
    """A request id: None, or a non-empty string of at most 256 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 256:
        raise ArgumentError(f"request_id must be None or a string of 1 to 256 characters, got {value!r:.60}")
    return value


@runtime_checkable
class CacheAPI(Protocol):
    """Blocks by key, whichever process holds them. Every method is
    thread-safe. Keys of one call are consecutive blocks of one prompt
    (keys[i-1] is the parent of keys[i]) where a method says so."""

    def lookup(self, keys: Sequence[Key]) -> int:
        """Length of the longest cached prefix of `keys` (0 on any fault)."""

    def locate(self, keys: Sequence[Key]) -> list[Optional[str]]:
        """The name of the fastest tier holding each key, or None."""

    def begin_request(self, request_id: str, keys: Sequence[Key], parent: Optional[Key] = None) -> None:
        """One request over the prompt `keys`: the access the policy counts,
        once. Later calls that carry `request_id` count nothing more. A
        second begin with the same id is ignored (a preempted request)."""

    def store(self, keys: Sequence[Key], srcs: Sequence[Any], parent: Optional[Key] = None,
              request_id: Optional[str] = None) -> Handle:
        """Stores consecutive blocks (`parent` precedes keys[0]); a block is
        DONE when it is cached (already, or now). Sources must stay
        unchanged until the handle is done."""

    def load(self, keys: Sequence[Key], dsts: Sequence[Any], request_id: Optional[str] = None) -> Handle:
        """Copies each block into its destination (sizes must match)."""

    def prefetch(self, keys: Sequence[Key], tier: Optional[str] = None) -> Handle:
        """Stages blocks held below the landing tier into it."""

    def write_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                    parent: Optional[Key] = None, request_id: Optional[str] = None) -> list[Outcome]:
        """The zero-copy store: calls `fill(first, slots, arena)` with, per
        block, the (offset, length) in `arena` to fill (None where the block
        is already cached or was refused), then makes the filled blocks
        cached. A `fill` that raises stores none of its slots (FAILED).
        Synchronous. Blocks after a refused one are MISSING."""

    def read_slots(self, keys: Sequence[Key], sizes: Sequence[int], fill: SlotFn,
                   request_id: Optional[str] = None) -> list[Outcome]:
        """The zero-copy load: calls `fill(first, slots, arena)` with, per
        block, the (offset, length) in `arena` of its bytes (None on a miss,
        or where the stored size is not sizes[i]: CORRUPT) while they are
        held. A `fill` that raises makes its DONE blocks FAILED. Synchronous."""

    def read_ranges(self, keys: Sequence[Key], offsets: Sequence[Sequence[int]], dsts: Sequence[Sequence[Any]],
                    request_id: Optional[str] = None) -> list[RangeRead]:
        """Byte ranges of blocks, read where the blocks are, without staging
        them: copies bytes [offsets[i][j], offsets[i][j] + len(dsts[i][j]))
        of block keys[i] into the writable buffer dsts[i][j]. A use of the
        blocks (as a load). Per block a RangeRead: DONE with the tier that
        served it and the bytes delivered, or MISSING / CORRUPT (also: a
        range past the block's end) / FAILED, its destinations then
        unspecified. Synchronous. How much a tier reads for a range is the
        implementation's (ucm/cache/ranges.py; the service's client stages
        whole blocks)."""

    def register_layout(self, layout: Any) -> None:
        """The `ucm.codecs.layout.KvLayout` of a namespace's blocks, which
        the codecs of the tiers below the landing tier encode with (a
        connector calls it once per namespace; idempotent)."""

    def pin(self, keys: Sequence[Key]) -> None:
        """Keeps the blocks cached until `unpin` (counted)."""

    def unpin(self, keys: Sequence[Key]) -> None: ...

    def finish(self, keys: Sequence[Key], output_tokens: int, request_id: Optional[str] = None) -> None:
        """Hint: the request over `keys` finished after `output_tokens`
        generated tokens (and its `request_id` is done with)."""

    def stats(self) -> dict[str, Any]: ...

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits until buffered writes are on their medium."""

    def close(self) -> None: ...


@runtime_checkable
class CatalogAPI(Protocol):
    """A cache that tells the routers above the engines what it holds (its
    block catalog, ucm.cache.catalog): UnifiedCache and the service's
    CacheClient. Optional beside CacheAPI: a cache without it publishes no
    KV events."""

    def describe(self, blocks: Sequence[Any]) -> None:
        """Describes blocks an engine stores, for the KV events routers
        read: [key, parent, tokens, extra] each (`check_blocks`)."""

    def events(self, since: int, epoch: Optional[int], limit: int = 256) -> dict:
        """The block catalog's changes after `since` for a reader of `epoch`
        ({"epoch", "next", "events", "reset"})."""

    def holdings(self, offset: int, limit: int = 256) -> dict:
        """The held described blocks from `offset` ({"blocks",
        "next_offset", "done"}), what a reader told to reset reads first."""
