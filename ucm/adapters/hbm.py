"""`hbm`: a device tensor pool.

One uint8 tensor of `capacity_bytes` on the accelerator (CUDA when present,
else the CPU, so the same code runs in tests), carved into fixed-size slots
in extents that size classes take and give back (ucm.adapters.slab), with
the key -> slot table of ucm.adapters.slots. Byte ranges of a blob are read
straight from the pool (`RangeReads`). A device pool has no file other
processes map: not `SharedSlots`.
Sources and destinations may be buffer-protocol objects or torch tensors on
any device; device-to-device copies stay on the device.
In vLLM the engine owns HBM; this tier serves standalone and transformers use.

Thread-safe: the slot table's lock guards the index; copies run outside it
(a slot being written is reserved and invisible until committed, a slot
being read is leased and never reused until released).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Optional, Sequence

from ucm.adapters.base import AdapterConfig, Key, RangeReads, Status, check_range_args
from ucm.adapters.slab import SlabArena
from ucm.adapters.slots import SlotTable
from ucm.buffers import byte_view
from ucm.errors import AdapterError, ArgumentError


class HbmConfig(AdapterConfig):
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N"


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise AdapterError("hbm: needs torch (the engine's own build: pip install torch)") from exc
    return torch


class HbmAdapter(RangeReads):
    name = "hbm"
    kv_medium = "CPU_TIER1"  # a pool beside the engine's pages, copied in like host memory
    Config = HbmConfig
    device_buffers = True

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
        self._slots = SlotTable(SlabArena(capacity_bytes, align=256), "hbm")

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
            self._slots.check_open()
            if self._slots.present(key):
                out.append(Status.OK)
                continue
            slot = self._slots.reserve(key, n) if n else None
            if slot is None:  # full, or another writer has the key
                out.append(Status.OK if self._slots.present(key, reserved=True) else Status.NO_SPACE)
                continue
            try:
                self._pool[slot.offset:slot.offset + n].copy_(src)
            except BaseException:
                self._slots.abort(key)
                raise
            if src.device.type == "cuda":  # queued on the stream: done before OK, the source may change after
                _torch().cuda.current_stream(src.device).synchronize()
            self._slots.commit(key)
            out.append(Status.OK)
        return out

    def get(self, keys: Sequence[Key], dsts: Sequence[Any]) -> list[Status]:
        if len(keys) != len(dsts):
            raise ArgumentError(f"get: {len(keys)} keys but {len(dsts)} destinations")
        ds = [self._as_tensor(d, True, "destination") for d in dsts]
        return [self._copy_out(key, d, None) for key, d in zip(keys, ds)]

    def get_range(self, keys: Sequence[Key], offsets: Sequence[int], dsts: Sequence[Any]) -> list[Status]:
        check_range_args(keys, offsets, dsts)
        ds = [self._as_tensor(d, True, "destination") for d in dsts]
        return [self._copy_out(key, d, off) for key, off, d in zip(keys, offsets, ds)]

    def _copy_out(self, key: Key, d: Any, offset: Optional[int]) -> Status:
        """Copies the blob of `key` (offset None: all of it, whose size must
        be the destination's) or the range at `offset` into `d`, under a lease."""
        slot = self._slots.lease(key)
        if slot is None:
            return Status.NOT_FOUND
        try:
            n = d.numel()
            if offset is None:
                if slot.length != n:
                    return Status.CORRUPT
                offset = 0
            elif offset + n > slot.length:
                return Status.CORRUPT
            start = slot.offset + offset
            d.copy_(self._pool[start:start + n])
            if self.device.type == "cuda":
                _torch().cuda.current_stream(self.device).synchronize()
            return Status.OK
        finally:
            self._slots.release(slot)

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        return self._slots.contains(keys)

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        return self._slots.delete(keys)

    def size_of(self, key: Key) -> Optional[int]:
        return self._slots.size_of(key)

    def iter_keys(self) -> Iterator[Key]:
        return iter(self._slots.keys())

    @property
    def capacity_bytes(self) -> int:
        return self._slots.arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    def footprint_bytes(self, size: int) -> int:
        """Pool bytes a blob of `size` bytes costs: its slot's share of its
        extent (what `used_bytes` counts; ucm.adapters.slab)."""
        return self._slots.footprint_bytes(size)

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "blocks": len(self._slots)}

    def close(self) -> None:
        if self._slots.close():
            self._pool = None
