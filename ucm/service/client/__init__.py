"""The engine side of the service: `CacheClient` (cache_client.py) over one
connection (conn.py, link.py), its slot data plane (slots.py) and streamed
loads (stream.py); spawn.py starts a private service when none runs.
Imports nothing of the server or the cache."""
