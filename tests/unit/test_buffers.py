"""ucm.buffers: host memory as flat bytes; device tensors only where the
cache's every tier takes them (a `meta` tensor stands in for a device one:
it has a device other than the CPU and no bytes to read by mistake)."""
import pytest

torch = pytest.importorskip("torch")

from ucm.buffers import block_buffer, byte_view  # noqa: E402
from ucm.errors import ArgumentError  # noqa: E402


def test_a_cpu_tensor_is_a_view_of_its_own_bytes():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    v = byte_view(t, writable=True)
    assert len(v) == 12 and bytes(v) == t.numpy().tobytes()
    v[0] = 9
    assert t[0, 0] == 9
    assert bytes(block_buffer(t, True, "x", device_ok=True)) == t.numpy().tobytes()  # host memory: a memoryview


def test_a_device_tensor_passes_only_where_the_tiers_take_it():
    t = torch.empty((4, 8), dtype=torch.bfloat16, device="meta")
    flat = block_buffer(t, True, "destination", device_ok=True)
    assert flat.device.type == "meta" and flat.dtype == torch.uint8 and len(flat) == 64  # len: bytes
    with pytest.raises(ArgumentError, match="source: a meta tensor has no host view"):
        block_buffer(t, False, "source", device_ok=False)
    with pytest.raises(ArgumentError, match="contiguous"):
        block_buffer(t.t(), False, "source", device_ok=True)


def test_the_cache_passes_device_tensors_only_when_every_tier_is_hbm():
    from ucm.cache.unified import UnifiedCache

    hbm = {"adapter": "hbm", "capacity": "1MiB", "options": {"device": "cpu"}}
    dram = {"adapter": "dram", "capacity": "1MiB", "options": {"prefault": False}}
    with UnifiedCache({"block_tokens": 16, "landing_tier": "hbm", "tiers": [hbm]}) as only_hbm:
        assert only_hbm._device_buffers
    with UnifiedCache({"block_tokens": 16, "landing_tier": "hbm", "tiers": [hbm, dram]}) as mixed:
        assert not mixed._device_buffers
        with pytest.raises(ArgumentError, match="only a cache whose every tier is hbm"):
            mixed.store([b"k" * 16], [torch.empty(8, device="meta")])
