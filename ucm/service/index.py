"""The shared key index: lookups without a round trip to the service.

The service mirrors the set of cached keys (what `UnifiedCache.lookup`
sees) into a hash table in a shared-memory file beside the arena; clients
map it read-only and answer `lookup` from it (ucm/index.hpp in the native
core: one writer, lock-free readers under a sequence counter). A reader that
cannot get a consistent view, or a table that overflowed, falls back to the
request over the socket, which stays the reference.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Optional

from ucm import _native
from ucm.service.paths import create_segment

log = logging.getLogger(__name__)


class KeyIndex:
    """The writer side, owned by the service (calls arrive under the
    cache's metadata lock, so one at a time)."""

    def __init__(self, directory: str, slots: int) -> None:
        self.slots = slots
        self.nbytes = _native.index_bytes(slots)
        self.path, m = create_segment(directory, "index", self.nbytes)
        self._map: Optional[mmap.mmap] = m
        _native.index_init(self._map, slots)
        self._full_warned = False

    def add(self, key: bytes) -> None:
        if self._map is not None and not _native.index_insert(self._map, key) and not self._full_warned:
            self._full_warned = True
            log.warning("ucm serve: the key index (%d slots) is full; lookups go through the socket from "
                        "now on (raise service.index_slots)", self.slots)

    def discard(self, key: bytes) -> None:
        if self._map is not None:
            _native.index_remove(self._map, key)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def map_index(path: str, nbytes: int) -> Optional[mmap.mmap]:
    """A read-only mapping of the service's index, or None when it cannot be
    used (lookups then go through the socket)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        log.debug("cannot open the key index %s: %s", path, exc)
        return None
    try:
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        log.debug("cannot map the key index %s: %s", path, exc)
        return None
    finally:
        os.close(fd)
    try:
        _native.index_count(m)
    except ValueError:
        m.close()
        return None
    return m
