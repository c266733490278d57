import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def engine_ipc_dir(tmp_path_factory):
    """vLLM names its ZMQ IPC sockets under VLLM_RPC_BASE_PATH (the temp dir
    by default) and leaves them there: a suite run left about 150 in /tmp.
    Here they go to this session's temp dir, which pytest removes in turn."""
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(tmp_path_factory.mktemp("ipc"))
    yield
    if old is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = old


@pytest.fixture
def nvme_dir(tmp_path):
    """A directory on a file system that takes O_DIRECT (tmp_path is on disk here)."""
    d = tmp_path / "nvme"
    d.mkdir()
    return str(d)


def blobs(n, size, seed=0):
    rnd = __import__("random").Random(seed)
    return [bytes(rnd.getrandbits(8) for _ in range(64)) * (size // 64) + os.urandom(size % 64) for _ in range(n)]


@pytest.fixture(scope="session")
def cluster_servers():
    """redis-server and mooncake_master on 127.0.0.1 for the cluster adapters,
    started once; their addresses reach NEEDS through environment variables.
    A missing binary leaves its variable unset, and NEEDS skips that adapter."""
    from ucm.bench.cache.cluster_io import MooncakeMaster, RedisServer, find_binary

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
