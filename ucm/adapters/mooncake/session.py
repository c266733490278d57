"""The mooncake adapter's session with the pool: one store client joined to
the master, set up again after an outage, probed in the background, with the
memory registered with it.

Setup. `StoreSession` makes a client (`store_factory()`) and joins the
master only after a TCP connect to the master's address succeeds, so that a
master that is down costs no client-side setup retries; if it is down when
the session starts, the prober thread retries every `probe_interval_s` until
it answers. A client that joined has the scratch memory and every buffer
the owner registered (`register_memory`) registered with it before it is
published (`store`), so a transfer never sees a half-registered client.

Health. Once joined, the prober (`ucm-mooncake-probe`) connects to the
master and asks the client's own health check every `probe_interval_s`, and
tells the circuit breaker (`probed`); `client()` hands the data path the
client only while the breaker allows calls.

Thread-safe. Lock order: `_setup_lock`, then `_lock`; the store client's
setup and registration calls run under `_setup_lock` only, its data calls
outside the session. The breaker has its own lock.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Callable

from ucm.adapters.cluster import CircuitBreaker
from ucm.adapters.mooncake.codes import MooncakeConfig, host_port
from ucm.adapters.mooncake.scratch import address
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError, ClosedError

log = logging.getLogger("ucm.adapters.mooncake.adapter")  # the adapter's messages, as before the split


class StoreSession:
    """A store client joined to the master, kept joined (module docstring)."""

    def __init__(self, config: MooncakeConfig, store_factory: Callable[[], Any], breaker: CircuitBreaker,
                 scratch: tuple[int, int]) -> None:
        """Tries to join the master now, then starts the prober thread.
        `scratch`: (address, length) of memory registered with every client
        this session sets up."""
        self.config = config
        self._store_factory = store_factory
        self._breaker = breaker
        self._scratch = scratch
        self._probe_addr = host_port(config.master)
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._regions: list[tuple[int, int, memoryview]] = []  # registered by the owner: start, end, view
        self._store: Any = None  # the client, once set up
        self._closed = False
        self._setups = 0
        # A failing setup retries 20 times by default (~90 s); a few are enough.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        if not self._try_setup():
            log.warning("mooncake: master %s not reachable now; the tier answers misses until it is",
                        config.master)
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="ucm-mooncake-probe", daemon=True)
        self._prober.start()

    @property
    def store(self) -> Any:
        """The client (None until set up), whatever the breaker says."""
        return self._store

    @property
    def setups(self) -> int:
        """How many clients joined the master so far."""
        return self._setups

    def client(self) -> Any:
        """The client if calls may go to the network now, else None.
        Raises ClosedError after `stop()`."""
        with self._lock:
            if self._closed:
                raise ClosedError("mooncake adapter used after close()")
            store = self._store
        return store if store is not None and self._breaker.allows() else None

    # ---- memory registration -----------------------------------------------
    def register_memory(self, buf: Any) -> None:
        """Registers long-lived memory with the client now and with every
        later one. The caller keeps `buf` alive until `unregister_memory(buf)`
        or `close()`."""
        view = byte_view(buf, what="buffer")
        start = address(view)
        with self._setup_lock:
            with self._lock:
                if any(s < start + len(view) and start < e for s, e, _ in self._regions):
                    raise ArgumentError("mooncake: buffer overlaps memory registered already")
            if self._store is not None:
                rc = self._store.register_buffer(start, len(view))
                if rc != 0:
                    raise AdapterError(f"mooncake: registering {len(view)} bytes failed ({rc})")
            with self._lock:
                self._regions.append((start, start + len(view), view))

    def unregister_memory(self, buf: Any) -> None:
        start = address(byte_view(buf, what="buffer"))
        with self._setup_lock:
            with self._lock:
                kept = [r for r in self._regions if r[0] != start]
                if len(kept) == len(self._regions):
                    raise ArgumentError("mooncake: buffer was not registered")
                self._regions = kept
            if self._store is not None:
                self._store.unregister_buffer(start)

    def registered(self, addr: int, n: int) -> bool:
        """Whether `n` bytes at `addr` lie in memory the owner registered."""
        with self._lock:
            return any(s <= addr and addr + n <= e for s, e, _ in self._regions)

    # ---- setup and probing -------------------------------------------------
    def _tcp_probe(self) -> bool:
        if self._probe_addr is None:
            return True
        try:
            with socket.create_connection(self._probe_addr, timeout=self.config.probe_timeout_s):
                return True
        except OSError:
            return False

    def _try_setup(self) -> bool:
        c = self.config
        with self._setup_lock:
            if self._store is not None:
                return True
            if self._closed or not self._tcp_probe():
                return False
            store = self._store_factory()
            rc = store.setup(c.local_hostname, c.metadata_server, c.segment_size, c.local_buffer_size,
                             c.protocol, c.device_name, c.master)
            if rc != 0:
                log.warning("mooncake: setup against master %s failed (%s)", c.master, rc)
                store.close()
                return False
            regions = [self._scratch]
            with self._lock:
                regions += [(s, e - s) for s, e, _ in self._regions]
            for addr, n in regions:
                rc = store.register_buffer(addr, n)
                if rc != 0:
                    log.error("mooncake: registering %d bytes at %#x failed (%s)", n, addr, rc)
                    store.close()
                    return False
            with self._lock:
                self._store = store
                self._setups += 1
            log.info("mooncake: joined master %s as %s (segment %d bytes, %s)", c.master, c.local_hostname,
                     c.segment_size, c.protocol)
            return True

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            try:
                if self._store is None:
                    self._try_setup()
                    continue
                ok = self._tcp_probe() and self._store.health_check() == 0
            except Exception:  # a probe must never kill the thread
                log.exception("mooncake: health probe failed")
                ok = False
            self._breaker.probed(ok)

    # ---- shutdown ------------------------------------------------------------
    def stop(self) -> bool:
        """Refuses further calls (`client()` raises ClosedError) and stops
        the prober; the client stays joined for transfers still running.
        False if the session was stopped already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._stop.set()
        self._prober.join(timeout=self.config.probe_timeout_s + 5.0)
        return True

    def close(self) -> None:
        """Leaves the pool (objects held in this node's segment go with it)
        and forgets the registered memory; after `stop()`, once no transfer
        runs."""
        with self._setup_lock:
            store, self._store = self._store, None
            if store is not None:
                store.close()
        with self._lock:
            self._regions.clear()
