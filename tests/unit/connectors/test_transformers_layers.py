"""SpareLayer (ucm/connectors/transformers/layers.py) against transformers'
DynamicLayer: the same keys and values after any sequence of prefills,
decode steps, growth past its room, crops and batch selections; views it
handed out are never overwritten below their length; adopted buffers are
written in place."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from ucm.connectors.transformers.kv_copy import byte_view, spans_into_layers  # noqa: E402
from ucm.connectors.transformers.layers import SpareLayer  # noqa: E402

B, H, D = 2, 3, 8


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _same(a, b):
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_updates_growth_and_crop_match_a_dynamic_layer():
    mine, ref = SpareLayer(room=4), DynamicLayer()
    seed = 0
    for step in [7, 1, 1, 1, 1, 1, 3, 9, 1]:  # a prefill, decode steps past the room, more chunks
        seed += 1
        k, v = _kv(step, seed)
        out, want = mine.update(k, v), ref.update(k, v)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and _same(mine, ref)
    assert mine.get_seq_length() == ref.get_seq_length() == 25
    held = mine.keys.clone(), mine.keys  # a view handed out (a store thread may read it)
    mine.crop(-5)
    ref.crop(-5)
    assert _same(mine, ref)
    for s in range(3):  # after a crop: new positions never land in the old buffers
        k, v = _kv(2, 100 + s)
        mine.update(k, v)
        ref.update(k, v)
        assert _same(mine, ref)
    assert torch.equal(held[0], held[1])


def test_a_replaced_tensor_leaves_the_buffers():
    mine, ref = SpareLayer(), DynamicLayer()
    for layer in (mine, ref):
        layer.update(*_kv(6, 1))
    idx = torch.tensor([1])
    mine.batch_select_indices(idx)
    ref.batch_select_indices(idx)
    k, v = _kv(1, 2)
    mine.update(k[1:], v[1:])
    ref.update(k[1:], v[1:])
    assert _same(mine, ref) and mine.keys.shape[0] == 1
    mine.reset()
    ref.reset()
    mine.update(*_kv(3, 3))
    ref.update(*_kv(3, 3))
    assert _same(mine, ref)


def test_adopted_buffers_are_written_in_place_and_views_kept():
    kbuf, vbuf = torch.zeros(B, H, 12, D), torch.zeros(B, H, 12, D)
    pk, pv = _kv(5, 7)
    kbuf[:, :, :5], vbuf[:, :, :5] = pk, pv
    mine, ref = SpareLayer(), DynamicLayer()
    mine.adopt(kbuf, vbuf, 5)
    ref.update(pk, pv)
    first = mine.keys
    k, v = _kv(4, 8)
    mine.update(k, v)
    ref.update(k, v)
    assert _same(mine, ref) and mine.keys.data_ptr() == kbuf.data_ptr()  # no new tensor
    assert torch.equal(first, pk)


def test_spans_into_layers_places_every_head_and_token():
    layers, bt, cap = 2, 4, 11
    blocks = torch.randn(2, layers, 2, H, bt, D)  # two payloads, [layers, 2, heads, bt, dim] each
    arena = torch.zeros(3 * blocks[0].numel())
    at = [blocks[0].numel() // 2, 2 * blocks[0].numel()]  # element offsets of the two payloads
    for off, p in zip(at, blocks):
        arena[off:off + p.numel()] = p.reshape(-1)
    ks = [torch.zeros(B, H, cap, D) for _ in range(layers)]
    vs = [torch.zeros(B, H, cap, D) for _ in range(layers)]
    item = arena.element_size()
    spans = [(at[0] * item, 2, bt), (at[1] * item, 2 + bt, 3)]  # the second block only in part
    spans_into_layers(byte_view(arena), spans, blocks[0].shape, item, [byte_view(k) for k in ks],
                      [byte_view(v) for v in vs], 1, cap, range(layers))
    for layer in range(layers):
        for t, j in ((ks[layer], 0), (vs[layer], 1)):
            assert torch.equal(t[1, :, 2:6], blocks[0, layer, j])
            assert torch.equal(t[1, :, 6:9], blocks[1, layer, j, :, :3])
            assert not t[0].any() and not t[1, :, :2].any() and not t[1, :, 9:].any()
