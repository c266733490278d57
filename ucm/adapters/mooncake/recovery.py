"""The mooncake adapter's recovery from dead holders: objects the master
still lists whose transfer failed because the node holding them is gone.

A node that dies leaves its objects listed by the master until its
`client_ttl` runs out (seconds, or for good with a long one): a read of one
fails its transfer, and lookups keep counting it. `DeadHolderRecovery`
asks the master where every replica of such an object lives; when each is
in memory at an endpoint that refuses a TCP connection (nothing listens
there: its process is gone, a restarted node listens elsewhere), it removes
the object from the pool, so that lookups stop counting it and a later put
writes it again. Any other failed transfer (a holder that accepts
connections or does not answer, a replica on disk, an endpoint that is not
host:port, a client that cannot describe the replicas) is a transient fault:
the object is left alone and the next read that fails asks again.

An object at a dead holder that could not be removed is remembered as
unreadable, and this instance stops relying on it (its budget forgets it):
a put of its key first removes it (`clear_for_put`), and a put never
answers "already present" for it (`is_unreadable`). A read that returns it
whole, or removes it, forgets it again (`readable`).

Thread-safe: one lock of its own, never held while calling the store client
or the budget.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Iterable, Sequence

from ucm.adapters.base import Key
from ucm.adapters.cluster import ClusterBudget
from ucm.adapters.mooncake.codes import OBJECT_NOT_FOUND, host_port

log = logging.getLogger("ucm.adapters.mooncake.adapter")  # the adapter's messages, as before the split


def force_remove(store: Any, names: list[str]) -> list[int]:
    """Force-removes objects; a client that raises removed none (-1 each:
    a failure, never an exception out of get or put)."""
    try:
        return list(store.batch_remove(names, True))
    except Exception:
        log.warning("mooncake: removing %d objects failed", len(names), exc_info=True)
        return [-1] * len(names)


class DeadHolderRecovery:
    """Removes objects held only at dead endpoints; remembers those it could
    not remove (module docstring)."""

    def __init__(self, key_prefix: str, probe_timeout_s: float, budget: ClusterBudget) -> None:
        """`key_prefix`: what the adapter puts before a key's hex digits in
        an object's name; `probe_timeout_s`: how long a connect to an
        endpoint may take before it says nothing about the holder."""
        self._prefix = key_prefix
        self._probe_timeout_s = probe_timeout_s
        self._budget = budget
        self._lock = threading.Lock()
        self._unreadable: set[Key] = set()  # found unreadable, not removed: a put must write them anew

    def any_unreadable(self) -> bool:
        """Whether some key is remembered as unreadable (a put asks this
        before looking its keys up)."""
        return bool(self._unreadable)

    def is_unreadable(self, key: Key) -> bool:
        with self._lock:
            return key in self._unreadable

    def readable(self, keys: Iterable[Key]) -> None:
        """A read returned these objects whole, or found them removed: they
        are no longer remembered as unreadable."""
        with self._lock:
            for key in keys:
                self._unreadable.discard(key)

    def clear_for_put(self, store: Any, keys: Sequence[Key], names: Sequence[str]) -> list[int]:
        """Removes the objects of keys found unreadable before (whose
        removal failed then) ahead of a put of them. Returns the indices of
        those still not removed: the put must answer FAILED for them (never
        "already present"). Caller holds no lock of the adapter."""
        with self._lock:
            idx = [i for i, k in enumerate(keys) if k in self._unreadable]
        if not idx:
            return []
        codes = force_remove(store, [names[i] for i in idx])
        stuck = []
        with self._lock:
            for i, code in zip(idx, codes):
                if code in (0, OBJECT_NOT_FOUND):
                    self._unreadable.discard(keys[i])
                else:
                    stuck.append(i)
        return stuck

    def remove_dead(self, store: Any, names: list[str]) -> list[bool]:
        """Of objects whose transfer failed while the master listed them at
        the right size: removes from the pool those whose every replica is in
        memory at an endpoint that refuses connections (the holder died; its
        segment stays listed until the master's client_ttl runs out). Per
        name: True if the object is no longer in the pool. Caller holds no
        lock of the adapter."""
        try:
            descs = store.batch_get_replica_desc(names)
        except Exception:  # the objects are left alone: the next read that fails asks again
            log.warning("mooncake: the replica descriptors of %d unreadable objects are unavailable; "
                        "they stay in the pool", len(names), exc_info=True)
            return [False] * len(names)
        refused: dict[str, bool] = {}  # endpoint -> refuses connections, probed once per call
        dead: list[str] = []
        for name in names:
            replicas = descs.get(name) or []
            endpoints = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                         for r in replicas if r.is_memory_replica()]
            if replicas and len(endpoints) == len(replicas) and all(self._refuses(ep, refused) for ep in endpoints):
                dead.append(name)
        if not dead:
            return [False] * len(names)
        codes = force_remove(store, dead)
        done = {n for n, c in zip(dead, codes) if c in (0, OBJECT_NOT_FOUND)}
        log.warning("mooncake: removed %d of %d objects held at dead endpoints %s", len(done), len(dead),
                    sorted(ep for ep, r in refused.items() if r))
        if len(done) < len(dead):
            stuck = [bytes.fromhex(name[len(self._prefix):]) for name in dead if name not in done]
            with self._lock:
                self._unreadable.update(stuck)
            self._budget.gone(stuck)  # not usable: this instance no longer relies on them
        return [n in done for n in names]

    def _refuses(self, endpoint: str, seen: dict[str, bool]) -> bool:
        """Whether a segment's transfer endpoint actively refuses a TCP
        connection (nothing listens there: its process is gone)."""
        if endpoint not in seen:
            addr = host_port(endpoint)
            refused = False
            if addr is not None:
                try:
                    with socket.create_connection(addr, timeout=self._probe_timeout_s):
                        pass
                except ConnectionRefusedError:
                    refused = True
                except OSError:
                    pass  # a timeout or an unreachable network says nothing about the holder
            seen[endpoint] = refused
        return seen[endpoint]
