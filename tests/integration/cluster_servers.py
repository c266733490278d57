"""Real servers and real "nodes" for the cluster-tier integration tests.

Servers (redis-server, mooncake_master, mooncake_http_metadata_server,
mooncake_client pool nodes) come from ucm.bench.cache.cluster_io: each binds
127.0.0.1 only, on a free port, logs to a file, and can be killed (SIGKILL)
and restarted on the same port. A missing binary skips the test that needs it.

A node is another process holding its own adapter (`NodeProcess`): the test
sends it JSON commands on stdin (put / get / contains / stats / exit) and
reads one JSON reply per command, so "node A stores, node B loads" crosses
a process boundary as it would between machines. Blocks are derived from a
seed (`blocks(seed, n, size)`) on both sides, and compared by SHA-256.

Run as a script (`python cluster_servers.py node`) it is the node itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def blocks(seed: int, n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    """`n` keys and payloads of `size` bytes, the same in every process."""
    keys, data = [], []
    for i in range(n):
        k = hashlib.blake2b(b"%d/%d" % (seed, i), digest_size=16).digest()
        keys.append(k)
        data.append(hashlib.shake_128(k).digest(size))
    return keys, data


def digest(b: Any) -> str:
    return hashlib.sha256(bytes(b)).hexdigest()


# ---- pytest side ---------------------------------------------------------------
try:
    import pytest
except ImportError:  # the node process does not need pytest
    pytest = None  # type: ignore[assignment]


def require(binary: str) -> None:
    from ucm.bench.cache.cluster_io import find_binary

    if find_binary(binary) is None:
        pytest.skip(f"{binary} is not installed")


def require_module(name: str) -> None:
    pytest.importorskip(name)


if pytest is not None:
    from ucm.bench.cache.cluster_io import (MooncakeMaster, MooncakeMetadataServer, MooncakePoolNode,  # noqa: F401
                                      RedisServer)

    @pytest.fixture
    def redis_server(tmp_path) -> Iterator["RedisServer"]:
        require("redis-server")
        require_module("redis")
        s = RedisServer(workdir=str(tmp_path))
        s.start()
        yield s
        s.stop()

    @pytest.fixture
    def mooncake_master(tmp_path) -> Iterator["MooncakeMaster"]:
        require("mooncake_master")
        require_module("mooncake.store")
        m = MooncakeMaster(workdir=str(tmp_path))
        m.start()
        yield m
        m.stop()

    @pytest.fixture
    def mooncake_metadata(tmp_path) -> Iterator["MooncakeMetadataServer"]:
        require("mooncake_http_metadata_server")
        s = MooncakeMetadataServer(workdir=str(tmp_path))
        s.start()
        yield s
        s.stop()


class NodeProcess:
    """Another node: a process holding one adapter, driven over stdin/stdout."""

    def __init__(self, adapter: str, options: dict[str, Any], capacity: int = 256 << 20) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "cluster_servers.py"), "node"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.call({"op": "open", "adapter": adapter, "options": options, "capacity": capacity})

    def call(self, cmd: dict[str, Any], timeout_s: float = 60.0) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node exited with {self.proc.wait(timeout_s)} on {cmd['op']}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"node: {reply['error']}")
        return reply["result"]

    def put(self, seed: int, n: int, size: int) -> list[str]:
        return self.call({"op": "put", "seed": seed, "n": n, "size": size})

    def get(self, seed: int, n: int, size: int) -> list[tuple[str, Optional[str]]]:
        return [tuple(x) for x in self.call({"op": "get", "seed": seed, "n": n, "size": size})]

    def contains(self, seed: int, n: int) -> list[bool]:
        return self.call({"op": "contains", "seed": seed, "n": n})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"})
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "NodeProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- node side -----------------------------------------------------------------
def _serve() -> None:
    adapter = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "open":
                cls = adapter_class(cmd["adapter"])
                adapter = cls(capacity_bytes=cmd["capacity"], config=cls.Config(**cmd["options"]))
                result: Any = True
            elif op == "exit":
                if adapter is not None:
                    adapter.close()
                print(json.dumps({"result": True}), flush=True)
                return
            elif op == "put":
                keys, data = blocks(cmd["seed"], cmd["n"], cmd["size"])
                result = [s.value for s in adapter.put(keys, data)]
            elif op == "get":
                keys, _ = blocks(cmd["seed"], cmd["n"], 0)
                out = [bytearray(cmd["size"]) for _ in keys]
                st = adapter.get(keys, out)
                result = [(s.value, digest(o) if s.value == "ok" else None) for s, o in zip(st, out)]
            elif op == "contains":
                keys, _ = blocks(cmd["seed"], cmd["n"], 0)
                result = adapter.contains(keys)
            elif op == "stats":
                result = {k: v for k, v in adapter.stats().items() if isinstance(v, (int, float, bool, str))}
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"result": result}), flush=True)
        except Exception as exc:  # reported to the test, which fails on it
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


CLASSES = {"mooncake": ("ucm.adapters.mooncake", "MooncakeAdapter"), "redis": ("ucm.adapters.redis", "RedisAdapter"),
           "fs": ("ucm.adapters.fs", "FsAdapter")}


def adapter_class(name: str) -> Any:
    """The adapter class through its entry point, or from its module while
    the entry point is not declared (a development checkout)."""
    import importlib

    from ucm.adapters.base import load_adapter_class
    from ucm.errors import AdapterNotFoundError

    try:
        return load_adapter_class(name)
    except AdapterNotFoundError:
        module, cls = CLASSES[name]
        return getattr(importlib.import_module(module), cls)


if __name__ == "__main__" and sys.argv[1:] == ["node"]:
    _serve()
