"""`hbm`: a device tensor pool.

One uint8 tensor of `capacity_bytes` on the accelerator (CUDA when present,
else the CPU, so the same code runs in tests), carved into fixed-size slots
in extents that size classes take and give back (ucm.adapters.slab).
Sources and destinations may be buffer-protocol objects or torch tensors on
any device; device-to-device copies stay on the device.
In vLLM the engine owns HBM; this tier serves standalone and transformers use.

Thread-safe: one lock guards the index; copies run outside it (a slot being
read is leased and never reused until released).
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from ucm.adapters.base import AdapterConfig, Key, Status, StorageAdapter
from ucm.adapters.slab import SlabArena
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError, ClosedError


class HbmConfig(AdapterConfig):
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N"


@dataclass(slots=True)
class _Slot:
    offset: int
    length: int
    leases: int = 0
    doomed: bool = False


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise AdapterError("hbm: needs torch; install ucm[torch] (torch==2.13.0)") from exc
    return torch


class HbmAdapter(StorageAdapter):
    name = "hbm"
    Config = HbmConfig

    def __init__(self, capacity_bytes: int, config: Optional[HbmConfig] = None) -> None:
        self.config = config or HbmConfig()
        torch = _torch()
        if capacity_bytes <= 0:
            raise ArgumentError(f"hbm: capacity_bytes must be > 0, got {capacity_bytes}")
        dev = self.config.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(dev)
            self._pool = torch.empty(capacity_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, AssertionError) as exc:
            raise AdapterError(f"hbm: cannot allocate {capacity_bytes} bytes on device {dev!r}: {exc}") from exc
        self._arena = SlabArena(capacity_bytes, align=256)
        self._lock = threading.Lock()
        self._index: dict[Key, _Slot] = {}
        self._closed = False

    def _as_tensor(self, obj: Any, writable: bool, what: str):
        torch = _torch()
        if isinstance(obj, torch.Tensor):
            if not obj.is_contiguous():
                raise ArgumentError(f"{what}: tensor must be contiguous")
            return obj.reshape(-1).view(torch.uint8)
        view = byte_view(obj, writable=writable, what=what)
        if not len(view):
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # read-only sources are only ever read
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(view, dtype=torch.uint8)

    def put(self, keys: Sequence[Key], blobs: Sequence[Any]) -> list[Status]:
        if len(keys) != len(blobs):
            raise ArgumentError(f"put: {len(keys)} keys but {len(blobs)} blobs")
        out: list[Status] = []
        for key, blob in zip(keys, blobs):
            src = self._as_tensor(blob, False, "blob")
            n = src.numel()
            with self._lock:
                self._check_open()
                if key in self._index:
                    out.append(Status.OK)
                    continue
                off = self._arena.alloc(n) if n else None
                if off is None:
                    out.append(Status.NO_SPACE)
                    continue
                slot = _Slot(off, n, leases=1)  # writer's lease until the copy is done
            self._pool[off:off + n].copy_(src)
            with self._lock:
                slot.leases -= 1
                self._index[key] = slot
            out.append(Status.OK)
        return out

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        out: list[Status] = []
        for key, dst in zip(keys, dsts):
            d = self._as_tensor(dst, True, "destination")
            with self._lock:
                self._check_open()
                slot = self._index.get(key)
                if slot is None:
                    out.append(Status.NOT_FOUND)
                    continue
                if slot.length != d.numel():
                    out.append(Status.CORRUPT)
                    continue
                slot.leases += 1
            try:
                d.copy_(self._pool[slot.offset:slot.offset + slot.length])
                if self.device.type == "cuda":
                    _torch().cuda.current_stream(self.device).synchronize()
            finally:
                self._release(slot)
            out.append(Status.OK)
        return out

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.leases -= 1
            if slot.doomed and slot.leases == 0:
                self._arena.free(slot.offset, slot.length)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        out = []
        with self._lock:
            for key in keys:
                slot = self._index.pop(key, None)
                if slot is None:
                    out.append(False)
                elif slot.leases:
                    slot.doomed = True
                    out.append(True)
                else:
                    self._arena.free(slot.offset, slot.length)
                    out.append(True)
        return out

    def size_of(self, key: Key) -> Optional[int]:
        with self._lock:
            slot = self._index.get(key)
            return None if slot is None else slot.length

    def iter_keys(self) -> Iterator[Key]:
        with self._lock:
            return iter(list(self._index))

    @property
    def capacity_bytes(self) -> int:
        return self._arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._arena.used_bytes

    def slot_bytes(self, size: int) -> int:
        """Pool bytes a blob of `size` bytes costs: its slot's share of its
        extent (what `used_bytes` counts; ucm.adapters.slab)."""
        return self._arena.footprint_bytes(size)

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "blocks": len(self._index)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._index.clear()
            self._pool = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("hbm adapter used after close()")
