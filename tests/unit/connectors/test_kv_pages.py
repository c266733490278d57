"""kv_pages: a page of any vLLM KV layout as contiguous byte chunks, in
memory order, covering exactly the page's bytes."""
import pytest

from ucm.connectors.kv_pages import find_page_dim, page_layout
from ucm.errors import ConfigError

torch = pytest.importorskip("torch")

B = 6  # KV blocks


def _layouts():
    """(name, layer tensor, page dim) in the layouts vLLM backends use."""
    big = torch.zeros(B, 3, 2, 4, 8, dtype=torch.int16)  # block-outermost: [B, L, H, N, C] in one buffer
    return [
        ("cpu [B,H,N,2D]", torch.zeros(B, 2, 4, 8, dtype=torch.int16), 0),
        ("flash-attn (2,B,N,H,D)", torch.zeros(2, B, 4, 2, 4, dtype=torch.int16), 1),
        ("flashinfer (B,2,N,H,D)", torch.zeros(B, 2, 4, 2, 4, dtype=torch.int16), 0),
        ("LHBNC view [B,H,N,C]", torch.zeros(2, B, 4, 8, dtype=torch.int16).permute(1, 0, 2, 3), 0),
        ("LBNHC view [B,H,N,C]", torch.zeros(B, 4, 2, 8, dtype=torch.int16).permute(0, 2, 1, 3), 0),
        ("layer 1 of a block-outermost buffer", big[:, 1], 0),
        ("layer 2 of a layer-major buffer",
         torch.zeros(3 * B * 64, dtype=torch.int16)[2 * B * 64:].view(B, 2, 4, 8), 0),
    ]


@pytest.mark.parametrize("name,t,dim", _layouts(), ids=[x[0] for x in _layouts()])
def test_chunks_cover_exactly_the_page_in_memory_order(name, t, dim):
    st = torch.empty(0, dtype=torch.int16).set_(t.untyped_storage())
    st.copy_(torch.arange(st.numel(), dtype=torch.int16))  # every element names its storage position
    assert find_page_dim(name, t.shape, B) == dim
    lay = page_layout(name, t.shape, t.stride(), t.element_size(), t.storage_offset(), dim)
    assert lay.num_pages == B and lay.page_bytes == t.select(dim, 0).numel() * 2
    offsets = [off for off, _ in lay.chunks]
    assert offsets == sorted(offsets)
    raw = st.view(torch.uint8)
    for p in range(B):
        got = torch.cat([raw[lay.base + p * lay.page_stride + off:][:n] for off, n in lay.chunks]).view(torch.int16)
        assert got.tolist() == sorted(t.select(dim, p).flatten().tolist())


def test_cpu_layout_is_one_chunk_per_page():
    lay = page_layout("l0", (364, 3, 128, 128), (49152, 16384, 128, 1), 2, 0, 0)
    assert lay.chunks == ((0, 98304),) and lay.page_stride == 98304 and lay.base == 0


def test_flash_attention_page_is_k_then_v():
    shape = (2, 100, 16, 8, 64)
    strides = (100 * 16 * 8 * 64, 16 * 8 * 64, 8 * 64, 64, 1)
    lay = page_layout("l0", shape, strides, 2, 0, find_page_dim("l0", shape, 100))
    assert lay.chunks == ((0, 16384), (100 * 16384, 16384)) and lay.payload_offsets == (0, 16384)


def test_refuses_pages_that_are_not_made_of_contiguous_chunks():
    t = torch.zeros(B, 4, 16)[:, :, ::2]  # every other element
    with pytest.raises(ConfigError, match=r"model.layers.3.attn.*\(6, 4, 8\).*\(64, 16, 2\)"):
        page_layout("model.layers.3.attn", t.shape, t.stride(), 4, 0, 0)
    t = torch.zeros(1, 4).expand(B, 4)  # pages alias each other
    with pytest.raises(ConfigError, match="alias"):
        page_layout("l", t.shape, t.stride(), 4, 0, 0)


def test_page_dim_must_be_unique_or_named_by_the_block_stride():
    with pytest.raises(ConfigError, match="no dimension"):
        find_page_dim("l", (7, 2, 16, 64), B)
    with pytest.raises(ConfigError, match=r"dimensions \[0, 2\]"):
        find_page_dim("l", (B, 2, B, 64), B)
    # (6, 2, 6, 64) contiguous, 2-byte items: dim 0 has a block stride of 1536 bytes
    assert find_page_dim("l", (B, 2, B, 64), B, (1536, 768, 128, 2), block_stride=1536) == 0
