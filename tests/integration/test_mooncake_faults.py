"""Faults of the Mooncake store client, injected by wrapping the real client
(`MooncakeAdapter(..., store_factory=...)`) against a real mooncake_master
on 127.0.0.1 (tests/conftest.py, `cluster_servers`)."""
from __future__ import annotations

import logging
import os

import pytest

from ucm.adapters.base import Status, load_adapter_class
from ucm.adapters.mooncake.codes import TRANSFER_FAIL

SIZE = 64 << 10


class FailingClient:
    """The real store client, except that, once armed, every batch get fails
    its transfer (a holder that cannot be read) and asking for the replica
    descriptors raises (a client fault)."""

    def __init__(self, real):
        self.real = real
        self.armed = False
        self.descriptor_calls = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        if self.armed:
            return [TRANSFER_FAIL] * len(names)
        return self.real.batch_get_into_multi_buffers(names, ptrs, sizes)

    def batch_get_replica_desc(self, names):
        if self.armed:
            self.descriptor_calls += 1
            raise RuntimeError("injected: replica descriptors")
        return self.real.batch_get_replica_desc(names)


@pytest.fixture
def master(cluster_servers):
    address = os.environ.get("UCMTEST_MOONCAKE_MASTER")
    if not address:
        pytest.skip("no mooncake_master here")
    return address


def test_a_client_fault_while_looking_for_dead_holders_is_logged_and_removes_nothing(master, tmp_path, caplog):
    pytest.importorskip("mooncake.store")
    from mooncake.store import MooncakeDistributedStore

    clients = []

    def factory():
        clients.append(FailingClient(MooncakeDistributedStore()))
        return clients[-1]

    cls = load_adapter_class("mooncake")
    config = cls.Config(master=master, segment_size="32MiB", local_buffer_size="16MiB",
                        key_prefix=f"faults/{tmp_path.name}/")
    a = cls(capacity_bytes=8 << 20, config=config, store_factory=factory)
    try:
        key, blob = os.urandom(16), os.urandom(SIZE)
        assert a.put([key], [blob]) == [Status.OK]
        client = clients[-1]
        client.armed = True
        with caplog.at_level(logging.WARNING, logger="ucm.adapters.mooncake.adapter"):
            assert a.get([key], [bytearray(SIZE)]) == [Status.FAILED]  # not read; left for the next read
        assert client.descriptor_calls == 1
        logged = [r for r in caplog.records if r.name == "ucm.adapters.mooncake.adapter"
                  and r.levelno >= logging.WARNING and r.exc_info is not None]
        assert logged and "injected: replica descriptors" in str(logged[0].exc_info[1])
        client.armed = False
        assert a.contains([key]) == [True]  # nothing was removed
        out = bytearray(SIZE)
        assert a.get([key], [out]) == [Status.OK] and bytes(out) == blob
    finally:
        a.close()
