"""The shared stores of the cluster-tier tests (test_cluster_tiers.py,
test_fs_tier.py): one backend per tier (a redis or Mooncake server, or a
shared directory) and the adapters (nodes) built on it. Not a test module."""
from __future__ import annotations

from cluster_servers import adapter_class

SIZE = 256 << 10
CAP = 64 << 20


class Backend:
    """One shared store and the adapters (nodes) built on it."""

    name = ""
    server = None  # the killable server, if any

    def __init__(self) -> None:
        self.made = []

    def options(self, **over):
        raise NotImplementedError

    def make(self, capacity=CAP, **over):
        cls = adapter_class(self.name)
        a = cls(capacity_bytes=capacity, config=cls.Config(**self.options(**over)))
        self.made.append(a)
        return a

    def raw_set(self, adapter, key: bytes, value: bytes) -> None:
        """Writes `value` under the block key, bypassing the adapter."""
        raise NotImplementedError

    def close(self) -> None:
        for a in self.made:
            a.close()


class RedisBackend(Backend):
    name = "redis"

    def __init__(self, server) -> None:
        super().__init__()
        import redis

        self.server = server
        self.raw = redis.Redis.from_url(server.url)

    def options(self, **over):
        return {"url": self.server.url, "retry_after_s": 0.3, "socket_timeout_s": 1.0, **over}

    def raw_set(self, adapter, key, value):
        self.raw.set(adapter.config.key_prefix.encode() + key.hex().encode(), value)


class MooncakeBackend(Backend):
    name = "mooncake"

    def __init__(self, master, metadata_server: str = "P2PHANDSHAKE") -> None:
        super().__init__()
        self.server = master
        self.metadata_server = metadata_server

    def options(self, **over):
        return {"master": self.server.address, "metadata_server": self.metadata_server, "segment_size": "64MiB",
                "local_buffer_size": "16MiB", "probe_interval_s": 0.2, "retry_after_s": 0.3, **over}

    def raw_set(self, adapter, key, value):
        name = adapter.key_name(key)
        adapter.client.remove(name, True)
        assert adapter.client.put(name, value) == 0


class FsBackend(Backend):
    name = "fs"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def options(self, **over):
        return {"path": self.path, "io_threads": 4, **over}

    def raw_set(self, adapter, key, value):
        with open(adapter.path_of(key), "wb") as f:
            f.write(value)
