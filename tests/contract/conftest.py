import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def cluster_servers():
    """redis-server and mooncake_master on 127.0.0.1 for the cluster adapters,
    started once; their addresses reach NEEDS through environment variables.
    A missing binary leaves its variable unset, and NEEDS skips that adapter."""
    from ucm.bench.cluster_io import MooncakeMaster, RedisServer, find_binary

    started, set_vars = [], []
    for var, cls, binary, attr in (("UCMTEST_REDIS_URL", RedisServer, "redis-server", "url"),
                                   ("UCMTEST_MOONCAKE_MASTER", MooncakeMaster, "mooncake_master", "address")):
        if os.environ.get(var) or find_binary(binary) is None:
            continue
        server = cls().start()
        started.append(server)
        os.environ[var] = getattr(server, attr)
        set_vars.append(var)
    yield
    for var in set_vars:
        os.environ.pop(var, None)
    for server in reversed(started):
        server.stop()
