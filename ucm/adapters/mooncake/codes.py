"""The mooncake adapter's options and the mooncake-store error codes it tells apart.

`MooncakeConfig` is validated on construction (unknown keys are errors). The
codes are mooncake-store's `ErrorCode` values (types.h), as the store client
returns them per item; `host_port` parses the host:port addresses the
master and the transfer endpoints are named by. Pure: no state.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from ucm.adapters.base import AdapterConfig
from ucm.config.sizes import parse_size

# mooncake-store ErrorCode values (types.h) the adapter tells apart.
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600  # also: the buffers add up to less than the object
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707  # the reader's lease ran out before the transfer completed
TRANSFER_FAIL = -800  # also: the buffers add up to more than the object
SIZE_CODES = frozenset({INVALID_PARAMS, TRANSFER_FAIL})
TENANT_QUOTA_EXCEEDED = -1700
UNREACHABLE = frozenset({-900, -901, -1010, -1011})  # RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_*


class MooncakeConfig(AdapterConfig):
    master: str  # mooncake_master RPC address, host:port
    metadata_server: str = "P2PHANDSHAKE"  # or http://host:port/metadata (mooncake_http_metadata_server)
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this node's segment at
    protocol: str = Field(default="tcp", pattern=r"^[a-z0-9_]+$")  # tcp, rdma, ...
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"
    segment_size: int = 256 << 20  # DRAM this node adds to the pool; 0: none
    local_buffer_size: int = 64 << 20  # the client's own transfer buffer
    key_prefix: str = Field(default="ucm/", min_length=1, max_length=256)
    replica_num: int = Field(default=1, ge=1, le=16)
    zero_copy_unregistered: Optional[bool] = None  # None: True on tcp, False otherwise (stage through scratch)
    staging_size: int = 64 << 20  # registered staging for unregistered buffers, split among `concurrency`
    chunk_bytes: int = 256 << 20  # bytes per store call; a larger batch is pipelined, two calls in flight
    concurrency: int = Field(default=4, ge=1, le=64)
    wait_s: float = Field(default=30.0, gt=0)  # wait for a free scratch area before answering FAILED
    retry_after_s: float = Field(default=1.0, ge=0)
    probe_interval_s: float = Field(default=0.5, gt=0)
    probe_timeout_s: float = Field(default=0.25, gt=0)
    force_delete: bool = True

    @field_validator("segment_size", "local_buffer_size", "chunk_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("staging_size", mode="before")
    @classmethod
    def _staging(cls, v: Any) -> int:
        n = parse_size(v)
        if n < (1 << 20):
            raise ValueError(f"must be at least 1MiB, got {n}")
        return n

    @field_validator("master")
    @classmethod
    def _master(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"must be host:port of mooncake_master, got {v!r}")
        return v


def host_port(addr: str) -> Optional[tuple[str, int]]:
    """(host, port) of a plain host:port address; None for other forms."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or "/" in addr:
        return None
    return host.strip("[]"), int(port)
