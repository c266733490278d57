"""The client, which every engine worker imports, loads neither the server
nor the cache implementation (nor their dependencies)."""
import subprocess
import sys


def test_importing_the_client_loads_no_server_and_no_cache():
    code = ("import ucm.service.client.cache_client, sys; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('ucm'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert "ucm.service.client.cache_client" in loaded and "ucm.api" in loaded
    assert not loaded & {"ucm.cache.unified", "ucm.placement.engine", "ucm.placement.heat", "ucm.placement.policies.reuse", "ucm.service.server.serve",
                         "ucm.service.server.metrics", "ucm.service.server.handlers", "ucm.service.server.loop"}, sorted(loaded)
