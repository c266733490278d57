"""The engine side of the service: `CacheClient` (cache_client.py) over one
`Connection` (conn.py, its links in link.py), its slot data plane
(slots.py) and streamed loads (stream.py), which use the connection only
through its public methods; spawn.py starts a private service when none
runs. Imports nothing of the server or the cache."""
