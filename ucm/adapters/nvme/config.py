"""The nvme adapter's options: `NvmeConfig`, validated on construction.

Unknown keys are errors (`AdapterConfig`); sizes accept "16MiB"-style
strings and must be whole pages (O_DIRECT moves 4 KiB-aligned pieces); a
verified chunk may not exceed a region. Pure: no state.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from ucm.adapters.base import AdapterConfig
from ucm.adapters.nvme.format import ALIGN
from ucm.config.sizes import parse_size


class NvmeConfig(AdapterConfig):
    path: str  # a directory (a file is created in it) or a block device
    region_size: int = 16 << 20
    io_threads: int = Field(default=4, ge=1, le=64)
    io_chunk: int = 1 << 20  # bytes per write request; a region write has several in flight
    write_buffers: int = Field(default=2, ge=1, le=64)  # region buffers in memory
    direct_io: bool = True  # O_DIRECT; falls back to buffered I/O where refused
    usable_fraction: float = Field(default=0.85, gt=0.0, le=1.0)
    retry_after_s: float = Field(default=5.0, ge=0.0)
    put_timeout_s: float = Field(default=30.0, gt=0.0)
    # bytes per verified chunk (docs/lab/design-notes.md, "Checksum granularity"): what a range read
    # reads at least, and 8 bytes of footer and index per chunk
    chunk_bytes: int = 32 << 10

    @field_validator("region_size", "io_chunk", "chunk_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        n = parse_size(v)
        if n < ALIGN or n % ALIGN:
            raise ValueError(f"must be a positive multiple of {ALIGN} bytes, got {n}")
        return n

    @model_validator(mode="after")
    def _chunk_fits_a_region(self) -> "NvmeConfig":
        if self.chunk_bytes > self.region_size:
            raise ValueError(f"chunk_bytes ({self.chunk_bytes}) must not exceed region_size ({self.region_size})")
        return self
