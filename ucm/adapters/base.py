"""The storage-adapter interface, its optional abilities, value types and registry.

An adapter stores opaque blobs by 16-byte key in one medium. Every data-path
call is batched and returns one `Status` per item: a miss, a full medium or a
bad checksum is a value, never an exception. Only construction, closed use
and misuse (wrong buffer sizes or types) raise, with typed errors from
`ucm.errors`. Adapters are thread-safe: any method may be called from any
thread. Placement (what to keep, what to evict) is decided by the cache; an
adapter that must drop blocks on its own (a log-structured store reclaiming a
region) reports them through `drain_dropped()`.

The base contract (`StorageAdapter`) is what every adapter has: batched
put/get/contains/delete, size_of, iter_keys/iter_entries, capacity and used
bytes, `footprint_bytes(size)` (what one blob costs in `used_bytes`), `flush`
(a no-op but for buffered media), stats and close.

Optional abilities are abstract subclasses an adapter declares by inheriting
them; ask with `isinstance(adapter, SharedSlots)`, never by probing for
methods:

- `SharedSlots`: two-phase, zero-copy slots in a shared-memory segment that
  other processes map (reserve/commit/abort, lease/release, slot_offset,
  segment_path, victims_for). `dram`.
- `RangeReads`: reads of a byte range of a stored blob (`get_range`)
  without copying the whole blob. `dram`, `hbm`, `nvme` and `fs` (which
  read and verify only the checksummed chunks covering the range). Callers
  that want a range from any adapter use `read_range`, which falls back to
  a whole-blob get (`redis`, `mooncake`).
- `PaddedReads`: whole-blob reads into destinations padded to the medium's
  read unit (`get_padded`), so a medium that reads whole aligned units
  (O_DIRECT) lands a blob of any length in the caller's buffer instead of
  in its own scratch and then a copy. `nvme`; the codec tier reads its
  frames (never whole pages) through it.
- `ReadAhead`: a hint to start reading blobs before they are asked for
  (`read_ahead`), by a tier that reads into its own memory first (the
  codec tier), so that the read overlaps the steps before it (a staging's
  demotions, ucm/tiers/stack.py).

Each adapter class has a `Config` (a frozen pydantic model, unknown keys
forbidden) and is built as `cls(capacity_bytes=..., config=cls.Config(...))`.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from ucm.buffers import byte_view
from ucm.errors import AdapterError, AdapterNotFoundError, ArgumentError

ADAPTER_NAMESPACE = "ucm.adapters"
Key = bytes


class Status(enum.Enum):
    OK = "ok"
    NOT_FOUND = "not_found"  # a miss
    NO_SPACE = "no_space"  # the medium is full (or the device said ENOSPC)
    CORRUPT = "corrupt"  # bytes came back with a bad checksum or foreign header
    FAILED = "failed"  # I/O error, dead service, timeout


class BlockEntry(NamedTuple):
    """A block an adapter holds: its key, stored size and prefix-tree parent
    (None for a root, or where the adapter does not record parents)."""

    key: Key
    size_bytes: int
    parent: Optional[Key]


class AdapterConfig(BaseModel):
    """Base of every adapter's options: frozen, unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StorageAdapter(abc.ABC):
    """Opaque blobs by key in one medium."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[AdapterConfig]] = AdapterConfig
    # True for a medium other nodes write to as well (a cluster store): the
    # cache asks it directly for blocks it has no record of.
    shared: ClassVar[bool] = False
    # The medium routers credit this tier's blocks as, in the KV events'
    # words (ucm.cache.catalog; docs/operations.md, "KV events"): CPU_TIER1
    # for host memory, DISK for a local drive, EXTERNAL for a store off the
    # node. None: the tier's blocks are not advertised.
    kv_medium: ClassVar[Optional[str]] = None
    # True when put, get (and get_range) also take contiguous torch tensors on
    # an accelerator as sources and destinations, and a put's copy is done
    # when it returns (the `hbm` tier). A cache whose every tier says so
    # passes such tensors through (ucm.buffers.block_buffer); any other
    # cache refuses them with an ArgumentError.
    device_buffers: ClassVar[bool] = False

    @abc.abstractmethod
    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        """Stores each blob (a buffer-protocol object) under its key. A key
        already present is left as it is (OK): blobs under a key never change."""

    def put_with_parents(self, keys: Sequence[Key], blobs: Sequence[Any],
                         parents: Sequence[Optional[Key]]) -> list[Status]:
        """`put`, with each key's prefix-tree parent (None for a root). An
        adapter that keeps parents across a restart (see `iter_entries`)
        overrides it; by default the parents are ignored."""
        return self.put(keys, blobs)

    @abc.abstractmethod
    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        """Copies each blob into its writable destination buffer, whose size
        must equal the stored blob's (otherwise CORRUPT)."""

    @abc.abstractmethod
    def contains(self, keys: Sequence[Key]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Removes each key; True if it was present."""

    @abc.abstractmethod
    def size_of(self, key: Key) -> int | None:
        """Stored length of the blob under `key`, or None."""

    @abc.abstractmethod
    def iter_keys(self) -> Iterator[Key]:
        """Every key currently held (recovery, inspection); a snapshot."""

    def iter_entries(self) -> Iterator[BlockEntry]:
        """Every block currently held with its size and parent (recovery); a
        snapshot. By default from `iter_keys` and `size_of`, without parents."""
        for key in list(self.iter_keys()):
            size = self.size_of(key)
            if size is not None:
                yield BlockEntry(key, size, None)

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int: ...

    def footprint_bytes(self, size: int) -> int:
        """Bytes a blob of `size` bytes occupies in this medium: what one put
        of it adds to `used_bytes` (a slot rounded up to its class, a header,
        alignment), so that an owner counting blocks by it runs out when the
        medium does. By default `size`."""
        return size

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Waits up to `timeout_s` until every put that returned OK is on the
        medium itself (not in a write buffer); True when it is, False on
        timeout. By default True: only buffered media override it."""
        return True

    def drain_dropped(self) -> list[Key]:
        """Keys the adapter dropped on its own since the last call."""
        return []

    def stats(self) -> dict[str, Any]:
        """Adapter-specific counters (bytes read/written, corrupt, errors)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "StorageAdapter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- optional abilities ----------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class Lease:
    """A committed blob held for reading (`SharedSlots.lease`): `view` is its
    bytes, at [`offset`, `offset` + `length`) of the segment file, and they
    neither change nor move until `release(lease)`. A handle: compared by
    identity; `record` is the issuing adapter's own record of the slot,
    for its use only (opaque to everyone else)."""

    key: Key
    offset: int
    length: int
    view: memoryview  # read-only use: the committed blob
    record: Any = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class SlotVictims:
    """Blocks to evict so that a slot can be reserved (`victims_for`).
    `any_one`: evicting any one of `keys` frees a slot of the size's own
    class (the owner's policy picks which); otherwise every key must go:
    together they empty the arena units the size needs."""

    keys: tuple[Key, ...]
    any_one: bool


class SharedSlots(StorageAdapter):
    """Ability: blobs in slots of one shared-memory segment (the file at
    `segment_path`) that other processes of the same user map, so that they
    copy in and out of slots themselves (the service hands slots to engine
    workers). Writing is two-phase: `reserve` a slot, fill its view, then
    `commit` (or `abort`) it. Reading is leased: `lease` pins a committed
    slot, `release` gives it back.

    Guarantees, which the cache and the service rely on:
    - A reserved, not yet committed key is invisible to `get`, `contains`,
      `size_of`, `iter_keys` and `lease`; a second `reserve` of it, or a
      `put` of it (which answers OK without writing), leaves the writer's
      slot alone.
    - A leased slot is never reused: its bytes stay as committed until the
      last lease on it is released, even when the key is deleted meanwhile
      (the slot is then freed on that last release, and a new blob under
      the same key takes another slot).
    - Every method is thread-safe; copies through views run outside the
      adapter's lock, so a caller may fill or read a view from any thread.
    - After `close()`, `reserve`, `lease` and `victims_for` raise
      `ucm.errors.ClosedError`.
    """

    @abc.abstractmethod
    def reserve(self, key: Key, size: int) -> Optional[memoryview]:
        """A writable view of a fresh slot of `size` bytes for `key`, to fill
        and then `commit` or `abort`; None when the key is already committed
        or reserved, or when no slot of that size is free (see
        `victims_for`). The view must be released before commit/abort."""

    @abc.abstractmethod
    def commit(self, key: Key) -> bool:
        """Makes the reserved slot of `key` visible as its blob; False when
        `key` has no reservation (never reserved, aborted or committed)."""

    @abc.abstractmethod
    def abort(self, key: Key) -> None:
        """Gives back the reserved slot of `key`; nothing when it has none
        (a committed blob is left as it is)."""

    @abc.abstractmethod
    def lease(self, key: Key) -> Optional[Lease]:
        """The committed blob of `key` held for reading (None on a miss or
        while it is only reserved). Every lease must be given back with
        `release`, once."""

    @abc.abstractmethod
    def release(self, lease: Lease) -> None:
        """Gives back a lease (its view is released); the slot of a key
        deleted meanwhile is freed with its last lease."""

    @abc.abstractmethod
    def slot_offset(self, key: Key) -> Optional[tuple[int, int]]:
        """(offset, length) in the segment file of the committed or reserved
        slot of `key`, or None: where another process that maps
        `segment_path` finds the bytes."""

    @property
    @abc.abstractmethod
    def segment_path(self) -> str:
        """The shared-memory file other processes map (read-write, shared)."""

    @abc.abstractmethod
    def segment_view(self) -> memoryview:
        """A writable view of the whole segment in this process: what
        `slot_offset` and `Lease.offset` index (an in-process caller copies
        through it, as another process does through its own mapping)."""

    def victims_for(self, size: int,
                    acceptable: Optional[Callable[[tuple[Key, ...]], bool]] = None) -> SlotVictims:
        """What to evict when `reserve(key, size)` found no slot although the
        owner's byte count has room (the free bytes sit in slots of another
        size class): committed, unleased blocks that `acceptable` (asked with
        candidate keys, under the adapter's lock; it must not call the
        adapter) accepts. Empty when nothing can be freed. By default empty:
        a medium without size classes frees a slot by any eviction."""
        return SlotVictims((), any_one=False)


class RangeReads(StorageAdapter):
    """Ability: reads of a byte range of a stored blob, served by the medium
    without copying the whole blob. Declared only by adapters that do it
    natively; callers use `read_range`, which works with any adapter."""

    @abc.abstractmethod
    def get_range(self, keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[Any]) -> list[Status]:
        """For each key, copies bytes [offsets[i], offsets[i] + len(dsts[i]))
        of its stored blob into the writable buffer dsts[i]: OK, NOT_FOUND
        on a miss, CORRUPT when the range does not lie inside the blob.
        Raises ArgumentError for misuse: lists of different lengths, a
        negative offset, a destination that is not writable (see
        `check_range_args`)."""


class LayerReads(StorageAdapter):
    """Ability: a read of whole blobs that lands each in `layers` equal
    ranges, in order (a tier whose stored bytes must be decoded: the codec
    tier). Streamed loads use it where a tier has no RangeReads, so the
    first layers can be used before the last are decoded."""

    @abc.abstractmethod
    def get_layers(self, keys: Sequence[Key], dsts: Sequence[Any], layers: int,
                   landed: Callable[[int, int, int], None]) -> list[Status]:
        """As `get`, calling `landed(i, first, last)` once layer ranges
        [first, last) of dsts[i] hold their final bytes (from the calling
        thread; one call may cover several layers, and the calls for a
        block cover [0, layers) in order); a block that fails after some of
        its layers landed is still reported failed."""


class PaddedReads(StorageAdapter):
    """Ability: whole-blob reads into destinations padded to `read_unit`
    bytes; see `get_padded`."""

    read_unit: ClassVar[int] = 1  # bytes a destination's length and address are padded and aligned to

    @abc.abstractmethod
    def get_padded(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        """As `get`, but dsts[i] may be longer than the stored blob, up to
        its size rounded up to `read_unit`: the blob lands in its first
        `size_of` bytes and the rest is unspecified (the medium's padding).
        A destination that is the rounded size long and starts at a
        multiple of `read_unit` is read into in place. A destination shorter
        than the blob, or longer than its rounded size, is CORRUPT (as a
        size mismatch is for `get`)."""


class ReadAhead(StorageAdapter):
    """Ability: reads begun before they are asked for; see `read_ahead`."""

    @abc.abstractmethod
    def read_ahead(self, keys: Sequence[Key]) -> None:
        """Starts reading the blobs of `keys` in the background. The next
        `get` (or `get_layers`) of exactly these keys in this order uses
        what was read when every one of them was found and read; otherwise
        it reads as it would have. A blob never changes under its key, so
        either way it returns the same bytes. At most one read ahead is
        kept: a later `read_ahead`, or a read of other keys, drops an
        unused one. Never raises for the medium's faults."""


def check_range_args(keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[Any]) -> None:
    """The misuse `get_range` raises for: ArgumentError naming the value."""
    if not len(keys) == len(offsets) == len(dsts):
        raise ArgumentError(f"get_range: {len(keys)} keys, {len(offsets)} offsets, {len(dsts)} destinations")
    for off in offsets:
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ArgumentError(f"get_range: offsets must be ints >= 0, got {off!r}")


def read_range(adapter: StorageAdapter, keys: Sequence[Key], offsets: Sequence[int],
               dsts: Sequence[Any]) -> list[Status]:
    """`get_range` on any adapter: the adapter's own when it declares
    RangeReads, otherwise one whole-blob `get` per distinct key into a
    scratch buffer and a copy of each slice (same statuses, same misuse
    errors)."""
    if isinstance(adapter, RangeReads):
        return adapter.get_range(keys, offsets, dsts)
    check_range_args(keys, offsets, dsts)
    views = [byte_view(d, writable=True, what="destination") for d in dsts]
    sizes: dict[Key, Optional[int]] = {}
    for key in keys:
        if key not in sizes:
            sizes[key] = adapter.size_of(key)
    fetch = [k for k, n in sizes.items() if n is not None]
    scratch = {k: bytearray(sizes[k] or 0) for k in fetch}
    got = dict(zip(fetch, adapter.get(fetch, [scratch[k] for k in fetch]))) if fetch else {}
    out: list[Status] = []
    for key, off, view in zip(keys, offsets, views):
        st = got.get(key, Status.NOT_FOUND)
        if st is Status.OK:
            blob = scratch[key]
            if off + len(view) > len(blob):
                st = Status.CORRUPT
            else:
                view[:] = memoryview(blob)[off:off + len(view)]
        out.append(st)
    return out


def adapter_names() -> list[str]:
    """Names of every installed adapter."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ADAPTER_NAMESPACE)})


def load_adapter_class(name: str) -> type[StorageAdapter]:
    names = adapter_names()
    if name not in names:
        raise AdapterNotFoundError(
            f"No {ADAPTER_NAMESPACE!r} driver found, looking for {name!r}; available: {names}"
        )
    from stevedore import DriverManager

    try:
        mgr = DriverManager(namespace=ADAPTER_NAMESPACE, name=name, invoke_on_load=False)
    except Exception as exc:  # a broken plugin must not be silently disabled
        raise AdapterError(f"{ADAPTER_NAMESPACE!r} driver {name!r} failed to load: {exc}") from exc
    cls = mgr.driver
    if not (isinstance(cls, type) and issubclass(cls, StorageAdapter)):
        raise AdapterError(f"{ADAPTER_NAMESPACE!r} driver {name!r} is {cls!r}, not a StorageAdapter subclass")
    return cls
