"""The storage-adapter interface, its value types and its registry.

An adapter stores opaque blobs by 16-byte key in one medium. Every data-path
call is batched and returns one `Status` per item: a miss, a full medium or a
bad checksum is a value, never an exception. Only construction, closed use
and misuse (wrong buffer sizes or types) raise, with typed errors from
`ucm.errors`. Adapters are thread-safe: any method may be called from any
thread. Placement (what to keep, what to evict) is decided by the cache; an
adapter that must drop blocks on its own (a log-structured store reclaiming a
region) reports them through `drain_dropped()`.

Each adapter class has a `Config` (a frozen pydantic model, unknown keys
forbidden) and is built as `cls(capacity_bytes=..., config=cls.Config(...))`.
"""
from __future__ import annotations

import abc
import enum
from typing import Any, ClassVar, Iterator, NamedTuple, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from ucm.errors import AdapterError, AdapterNotFoundError

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
