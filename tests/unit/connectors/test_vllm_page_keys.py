"""Keys read back from vLLM for CPU's KV pages (ucm/connectors/vllm/page_keys.py):
PageKeys learns the order CPU_ATTN's own write gives a page's keys, for each
ISA this machine runs, and reads any position's key back as written."""
from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

from ucm.connectors.vllm.page_keys import PageKeys  # noqa: E402
from ucm.errors import ModelError  # noqa: E402


def _isas(dtype):
    out = [("vec16", 16), ("vec", 32), ("vec", 128)]
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        out.append(("amx", 128))
    return out


def _writer(isa):
    from vllm import _custom_ops as ops

    def write(key, value, kv_cache, slots):
        pages, heads, pt, two_d = kv_cache.shape
        k_cache, v_cache = kv_cache.view(pages, heads, 2 * pt, two_d // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    return write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_written_by_cpu_attn_read_back_as_written(dtype):
    heads, d = 3, 64
    torch.manual_seed(0)
    for isa, pt in _isas(dtype):
        write = _writer(isa)
        keys = PageKeys(write, heads, pt, d, dtype)
        cache = torch.zeros((9, heads, pt, 2 * d), dtype=dtype)
        pages = torch.tensor([7, 2, 5, 0], dtype=torch.int32)  # the request's pages, in its order
        n = 3 * pt + 5
        k, v = torch.randn((n, heads, d), dtype=dtype), torch.randn((n, heads, d), dtype=dtype)
        pos = torch.arange(n)
        write(k, v, cache, pages[pos // pt].long() * pt + pos % pt)
        assert torch.equal(keys.read(cache, pages, pos), k), isa
        some = torch.tensor([n - 1, 0, pt, 2 * pt + 3])
        assert torch.equal(keys.read(cache, pages, some), k[some]), isa


def test_a_write_that_does_not_keep_every_key_is_refused():
    def lossy(key, value, kv_cache, slots):  # every element of a page's keys from the token's first element
        pages, heads, pt, two_d = kv_cache.shape
        kv_cache.view(pages, heads, 2 * pt, two_d // 2)[0, :, :pt] = key[:, :, :1].transpose(0, 1)

    with pytest.raises(ModelError, match="not a permutation"):
        PageKeys(lossy, 2, 16, 8, torch.float32)
