"""`ucm serve`: the cache service, one per node, shared by every engine process.

It hosts a UnifiedCache. Control goes over a Unix domain socket (mode 0600
in a 0700 per-user directory) with the msgpack protocol of
ucm.service.protocol; payload bytes go through the shared-memory segment of
the landing tier (a `SharedSlots` adapter: dram), which clients map: a
client copies into a reserved slot and commits, or copies out of a leased
slot.

This module is the service's life cycle: bind the socket, build the cache
and its shared key index, run the event loop (ucm.service.server.loop) over the
ops (ucm.service.server.handlers), stop on SIGTERM/SIGINT, give everything back.

A connection owns its reservations, leases and pins; when it closes (the
client exited or was killed) they are given back. The service itself may be
killed at any instant: it persists nothing but the NVMe log, and a restart
serves what that log had sealed.

Threads: `start` and `serve_forever` run on the caller's thread (the
event loop's); `stop` may be called from any thread or a signal handler.
The cache, index and loop are built in `start` and torn down in `close`.
"""
from __future__ import annotations

import errno
import faulthandler
import logging
import os
import secrets
import signal
import socket
from typing import Optional

from ucm.adapters.base import SharedSlots, load_adapter_class
from ucm.cache.unified import UnifiedCache
from ucm.config.schema import UcmConfig
from ucm.errors import ConfigError, UcmError
from ucm.service.server.handlers import ServiceHandlers
from ucm.service.index import KeyIndex
from ucm.service.progress import ProgressArea

# Progress words of streamed loads in flight, all connections together
# (a stream of n blocks takes n + 1): 256 KiB.
PROGRESS_WORDS = 65536
from ucm.service.server.loop import EventLoop
from ucm.service.server.metrics import Metrics
from ucm.service.paths import (record_segment_dir, recorded_segment_dir, remove_stale_segments, runtime_dir,
                               socket_path)

__all__ = ["CacheService", "allowed_cpus", "check_landing_tier", "release_inherited_affinity", "runtime_dir",
           "serve", "socket_path"]

log = logging.getLogger(__name__)


def check_landing_tier(config: UcmConfig) -> None:
    """The service's data plane is the landing tier's shared segment: its
    adapter must declare `SharedSlots`. ConfigError otherwise, naming
    `landing_tier` and the configured tiers that would do."""
    def shared(name: str) -> bool:
        return issubclass(load_adapter_class(name), SharedSlots)

    if not shared(config.landing_tier):
        qualify = [t.adapter for t in config.tiers if t.adapter != config.landing_tier and shared(t.adapter)]
        raise ConfigError(f"landing_tier: the service needs a landing tier whose adapter has shared "
                          f"slots (SharedSlots: the data plane engines map), got {config.landing_tier!r}; "
                          f"tiers here that qualify: {qualify}")


class CacheService:
    """Hosts a UnifiedCache behind a Unix socket and a shared arena."""

    def __init__(self, config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> None:
        self.config = config
        self.private = private
        self.idle_exit_s = idle_exit_s
        self.path = socket_path(config)
        self.cache: Optional[UnifiedCache] = None
        self.index: Optional[KeyIndex] = None
        self.progress: Optional[ProgressArea] = None
        self.metrics: Optional[Metrics] = None
        self.handlers: Optional[ServiceHandlers] = None
        self._sock: Optional[socket.socket] = None
        self._loop: Optional[EventLoop] = None
        self._stop_early = False
        # This instance's identity: every slot it hands out carries it, so a
        # client never fills a slot through another instance's arena.
        self.epoch = secrets.randbits(62)

    # ---- life cycle --------------------------------------------------------
    def start(self) -> None:
        """Binds the socket (fails fast when another service owns it), then
        builds the cache; a failure on the way gives back what was built."""
        check_landing_tier(self.config)
        self._sock = self._bind()
        try:
            earlier = recorded_segment_dir(self.path)
            if earlier:  # a killed service's arena may fill the tmpfs the new one needs
                remove_stale_segments(earlier)
            self.cache = UnifiedCache(self.config)
            arena = self.cache.shared_arena()
            if not isinstance(arena, SharedSlots):
                raise ConfigError(f"landing_tier: {self.config.landing_tier!r} built no shared arena")
            segments = os.path.dirname(arena.segment_path)
            record_segment_dir(self.path, segments)
            if segments != earlier:
                remove_stale_segments(segments)
            if self.config.service.index_slots:
                self.index = KeyIndex(segments, self.config.service.index_slots)
                self.cache.watch_keys(self.index.add, self.index.discard)
            if self.config.service.metrics_port is not None:
                self.metrics = Metrics(self.cache, self.config.service.metrics_host,
                                       self.config.service.metrics_port)
            self.progress = ProgressArea(segments, PROGRESS_WORDS)
            self.handlers = ServiceHandlers(
                self.cache, arena, landing_tier=self.config.landing_tier, epoch=self.epoch, arena_inode=os.stat(arena.segment_path).st_ino,
                block_tokens=self.config.block_tokens, max_keys=self.config.service.max_keys,
                prefetch_timeout_s=self.config.service.request_timeout_s, socket=self.path,
                index=self.index, metrics=self.metrics, progress=self.progress)
        except BaseException:
            self.close()
            raise
        log.info("ucm serve: listening on %s (arena %s)", self.path, arena.segment_path)

    def _bind(self) -> socket.socket:
        """The listening socket at `self.path`, mode 0600 (the runtime
        directory is 0700). A socket file left by a killed service is
        replaced; one a live service answers on is an error."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.bind(self.path)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(self.path)
                    raise UcmError(f"a ucm service already listens on {self.path}")
                except (ConnectionRefusedError, FileNotFoundError):
                    os.unlink(self.path)  # left by a killed service
                    sock.bind(self.path)
                finally:
                    probe.close()
            # Not umask: it is process-wide, and other threads may create files.
            # The socket is 0600 before anyone can connect (listen comes after).
            os.chmod(self.path, 0o600)
            sock.listen(128)  # clients that come early wait in the backlog until the cache is ready
        except BaseException:
            sock.close()
            raise
        return sock

    def serve_forever(self) -> None:
        """Runs the event loop until `stop` (or idle, when private), then
        closes the service."""
        if self._sock is None or self.handlers is None:
            raise UcmError("CacheService.serve_forever: call start() first")
        svc = self.config.service
        self._loop = EventLoop(self._sock, self.handlers, workers=max(2, self.config.io_workers),
                               max_frame_bytes=svc.max_frame_bytes, poll_spin_s=svc.poll_spin_us / 1e6,
                               watchdog_s=svc.request_timeout_s / 3,
                               idle_exit_s=self.idle_exit_s if self.private else None)
        if self._stop_early:
            self._loop.stop()
        try:
            self._loop.run()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop_early = True
        if self._loop is not None:
            self._loop.stop()

    def close(self) -> None:
        """Stops accepting, lets requests in flight finish, gives back what
        every connection held, then closes the cache and its files."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._unlink_socket()
        if self._loop is not None:
            self._loop.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def _unlink_socket(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def allowed_cpus() -> set[int]:
    """The CPUs processes here may run on: the cgroup's cpuset, else every
    online CPU."""
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            text = f.read().strip()
    except OSError:
        text = ""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return set(range(os.cpu_count() or 1))
    return cpus or set(range(os.cpu_count() or 1))


def release_inherited_affinity() -> None:
    """A private service is started by an engine process, whose threads are
    often bound to a few cores (vLLM for CPU binds its OpenMP threads with
    VLLM_CPU_OMP_THREADS_BIND, and the worker process to one of them): the
    service must not inherit that binding, or every copy and NVMe request
    of the cache queues behind the engine's spinning threads on one core
    (measured: a 6 MB copy stalled for 30 s). It runs on every CPU allowed
    here instead."""
    want = allowed_cpus()
    try:
        if os.sched_getaffinity(0) != want:
            os.sched_setaffinity(0, want)
    except (OSError, AttributeError) as exc:  # a cpuset that changed meanwhile; non-Linux
        log.info("ucm serve: keeping the inherited CPU affinity (%s)", exc)


def serve(config: UcmConfig, private: bool = False, idle_exit_s: float = 5.0) -> int:
    """Runs the service until SIGTERM/SIGINT (or idle, when private). A
    private service first drops the CPU binding it inherited from the
    engine that started it (release_inherited_affinity); a service started
    by hand keeps whatever `taskset` or the unit file gave it."""
    if private:
        release_inherited_affinity()  # before any thread is started: they inherit it
    svc = CacheService(config, private=private, idle_exit_s=idle_exit_s)
    svc.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: svc.stop())
    # `kill -USR1 <pid>` writes every thread's stack to the service's stderr
    # (its log): what a stuck request waits on, without stopping the service.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(f"ucm serve: listening on {svc.path}", flush=True)
    svc.serve_forever()
    return 0
