"""Views of caller memory as flat bytes: buffer-protocol objects and CPU
torch tensors. Size and contiguity are checked; nothing is copied."""
from __future__ import annotations

import sys
from typing import Any

from ucm.errors import ArgumentError


def byte_view(obj: Any, writable: bool = False, what: str = "buffer") -> memoryview:
    """A 1-D unsigned-byte memoryview over `obj`'s memory (no copy)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ArgumentError(f"{what}: a {obj.device.type} tensor has no host view; use a CPU tensor "
                                "(only a cache whose every tier is hbm takes device tensors)")
        if not obj.is_contiguous():
            raise ArgumentError(f"{what}: tensor must be contiguous (shape {tuple(obj.shape)}, "
                                f"stride {obj.stride()})")
        obj = obj.reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(obj)
    except TypeError as exc:
        raise ArgumentError(f"{what}: {type(obj).__name__} does not expose the buffer protocol") from exc
    if writable and mv.readonly:
        raise ArgumentError(f"{what}: must be writable")
    if not mv.c_contiguous:
        raise ArgumentError(f"{what}: must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def block_buffer(obj: Any, writable: bool, what: str, device_ok: bool) -> Any:
    """`byte_view(obj)`, except that with `device_ok` a torch tensor on an
    accelerator stays where it is, as a flat uint8 tensor over the same
    memory (its len is its size in bytes, as a memoryview's): the buffer a
    cache of `device_buffers` tiers (ucm.adapters.base) hands them."""
    torch = sys.modules.get("torch")
    if device_ok and torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
        if not obj.is_contiguous():
            raise ArgumentError(f"{what}: tensor must be contiguous (shape {tuple(obj.shape)}, "
                                f"stride {obj.stride()})")
        return obj.reshape(-1).view(torch.uint8)
    return byte_view(obj, writable=writable, what=what)
