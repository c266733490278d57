"""Servers of the cluster tiers' stores, started on this machine for a
bench or a test: `redis-server`, `mooncake_master`, Mooncake's HTTP
metadata server and a `mooncake_client` pool node.

Each binds 127.0.0.1 only, writes its output to a log file in its own
working directory and is found beside this Python (a venv's bin/) or on
PATH. `start()` waits until it answers, `kill()` sends SIGKILL (for fault
tests), `restart()` starts it again on the same port, `stop()` ends it and
removes a working directory it made. Used by `ucm bench io --tier`
(cluster_io.py) and the integration tests; runs in the caller's thread.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from ucm.errors import AdapterError


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> Optional[str]:
    """`name` beside this Python (a venv's bin/) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(here, os.X_OK):
        return here
    return shutil.which(name)


def _port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class LocalServer:
    """One server process on 127.0.0.1, its output in a log file."""

    binary = ""
    install_hint = ""

    def __init__(self, port: Optional[int] = None, workdir: Optional[str] = None) -> None:
        path = find_binary(self.binary)
        if path is None:
            raise AdapterError(f"{self.binary} not found beside {sys.executable} nor on PATH; {self.install_hint}")
        self.path = path
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix=f"ucm-{self.binary}-")
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(self.workdir, f"{self.binary}-{self.port}.log")

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return _port_open(self.port)

    def start(self, timeout_s: float = 30.0) -> "LocalServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        logf = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv(), stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
        finally:
            logf.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AdapterError(f"{self.binary} exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   f"{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.05)
        self.kill()
        raise AdapterError(f"{self.binary} did not become ready on 127.0.0.1:{self.port} "
                           f"within {timeout_s}s; see {self.log_path}")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self, timeout_s: float = 30.0) -> "LocalServer":
        self.kill()
        return self.start(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(LocalServer):
    """redis-server without persistence, bound to 127.0.0.1."""

    binary = "redis-server"
    install_hint = "install it (Debian: apt-get install redis-server)"

    def __init__(self, port: Optional[int] = None, workdir: Optional[str] = None,
                 maxmemory: Optional[str] = None) -> None:
        super().__init__(port, workdir)
        self.maxmemory = maxmemory

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        a = [self.path, "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
             "--save", "", "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no"]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        return a

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class MooncakeMaster(LocalServer):
    """mooncake_master with its RPC and metrics on 127.0.0.1 (its built-in
    HTTP metadata server, which binds 0.0.0.0, stays off)."""

    binary = "mooncake_master"
    install_hint = "pip install mooncake-transfer-engine (or -non-cuda)"

    def __init__(self, port: Optional[int] = None, workdir: Optional[str] = None,
                 extra: Sequence[str] = ()) -> None:
        super().__init__(port, workdir)
        self.metrics_port = free_port()
        self.extra = list(extra)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [self.path, f"-rpc_port={self.port}", "-rpc_address=127.0.0.1", "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}", "-enable_http_metadata_server=false", *self.extra]


class MooncakeMetadataServer(LocalServer):
    """mooncake_http_metadata_server on 127.0.0.1 (for metadata_server:
    http://...; P2PHANDSHAKE needs none)."""

    binary = "mooncake_http_metadata_server"
    install_hint = "pip install mooncake-transfer-engine (or -non-cuda)"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metadata"

    def argv(self) -> list[str]:
        return [self.path, "--host", "127.0.0.1", "--port", str(self.port)]


class MooncakePoolNode(LocalServer):
    """mooncake_client: a process that only adds `segment_bytes` of its
    memory to the pool (a dedicated pool node)."""

    binary = "mooncake_client"
    install_hint = "pip install mooncake-transfer-engine (or -non-cuda)"

    def __init__(self, master: str, segment_bytes: int, metadata_server: str = "P2PHANDSHAKE",
                 port: Optional[int] = None, workdir: Optional[str] = None) -> None:
        super().__init__(port, workdir)
        self.master = master
        self.segment_bytes = segment_bytes
        self.metadata_server = metadata_server

    def argv(self) -> list[str]:
        mb = -(-self.segment_bytes // (1 << 20))
        return [self.path, "-host=127.0.0.1", f"-port={self.port}", f"-global_segment_size={mb}MB",
                f"-master_server_address={self.master}", f"-metadata_server={self.metadata_server}",
                "-protocol=tcp"]
