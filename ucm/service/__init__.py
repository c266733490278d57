"""The cache service (`ucm serve`) and its client."""
from ucm.service.client import CacheClient, ServiceUnavailable, connect
from ucm.service.server import CacheService, serve, socket_path

__all__ = ["CacheClient", "CacheService", "ServiceUnavailable", "connect", "serve", "socket_path"]
