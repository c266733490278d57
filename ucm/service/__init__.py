"""The cache service (`ucm serve`) and its client.

Names load lazily, so that importing the client (every engine worker
does) loads neither the server nor the cache:

- ucm.service.client.cache_client: CacheClient, ServiceUnavailable (the engine side);
- ucm.service.client.spawn: connect (a client, starting a private service);
- ucm.service.server.serve: CacheService, serve (the service process);
- ucm.service.paths: socket_path, runtime_dir.
"""
from importlib import import_module
from typing import Any

_WHERE = {"CacheClient": "client.cache_client", "ServiceUnavailable": "client.cache_client",
          "connect": "client.spawn", "CacheService": "server.serve", "serve": "server.serve",
          "socket_path": "paths", "runtime_dir": "paths"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ucm.service' has no attribute {name!r}")
    return getattr(import_module(f"ucm.service.{module}"), name)
