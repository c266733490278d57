"""The worker half of UCMConnector on fake CPU KV tensors in the layouts of
vLLM's CPU, FlashAttention and FlashInfer backends and as strided views into
one buffer: a block's payload is each layer's pages in order, each page its
bytes in memory order (K and V never re-interpreted); a save then a load
into other pages reproduces them exactly; SKIP pages are left alone.

Both copy paths run here: the native one (CPU tensors) and TorchPageCopier
(the path for CUDA tensors) forced onto CPU tensors. The CUDA specifics of
the latter (pinned arena, streams, events) are tested where a CUDA device
is present: tests/e2e/test_device_paths.py."""
import time

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from connector_fakes import JOIN_S, FakeCache  # noqa: E402
from ucm.connectors.kv_pages import SKIP  # noqa: E402
from ucm.connectors.torch_pages import TorchPageCopier  # noqa: E402
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata  # noqa: E402
from ucm.connectors.vllm.worker import UCMWorkerSide, default_copier  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

B, L, PPB = 10, 3, 2  # KV blocks, layers, pages per ucm block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def _bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _kv(layout):
    """Per layer: (tensor, page dim, page p's payload bytes)."""
    def rnd(*shape):
        return torch.randn(*shape).to(torch.bfloat16)

    if layout == "cpu":  # [B, H, N, 2*D], one contiguous page
        return {n: (rnd(B, 2, 16, 64), 0, lambda t, p: _bytes(t[p])) for n in NAMES}
    if layout == "flash_attn":  # (2, B, N, H, D): K then V, far apart
        return {n: (rnd(2, B, 16, 2, 32), 1, lambda t, p: _bytes(t[0, p]) + _bytes(t[1, p])) for n in NAMES}
    if layout == "flashinfer":  # (B, 2, N, H, D)
        return {n: (rnd(B, 2, 16, 2, 32), 0, lambda t, p: _bytes(t[p])) for n in NAMES}
    if layout == "block_outermost":  # one buffer [B, L, H, N, C]; layer l is a strided view
        big = rnd(B, L, 2, 16, 64)
        return {n: (big[:, i], 0, lambda t, p: _bytes(t[p])) for i, n in enumerate(NAMES)}
    if layout == "heads_outermost":  # [B, H, N, C] view of [H, B, N, C]: a page is one chunk per head
        return {n: (rnd(2, B, 16, 64).permute(1, 0, 2, 3), 0,
                    lambda t, p: b"".join(_bytes(t[p, h]) for h in range(2))) for n in NAMES}
    raise AssertionError(layout)


def _small_staging(storages, layouts, ppb):
    return TorchPageCopier(storages, layouts, ppb, staging_bytes=1)  # blocks go through staging one at a time


COPIERS = {"native": default_copier, "torch": _small_staging}


def _worker(kv, path):
    cache = FakeCache()
    w = UCMWorkerSide(cache, pages_per_block=PPB, num_kv_blocks=B, copier_factory=COPIERS[path])
    w.register_kv_caches({n: kv[n][0] for n in reversed(NAMES)})  # registration order is not layer order
    return w, cache


def _save(w, req_id, keys, pages, parent=None):
    """Submits one save as vLLM's wait_for_save would and waits until
    get_finished reports the request."""
    w.wait_for_save(UCMConnectorMetadata(stores=[StoreJob(req_id, keys, pages, parent)]))
    deadline = time.monotonic() + JOIN_S
    done = w.get_finished({req_id})[0] or set()
    while req_id not in done:
        assert time.monotonic() < deadline, "the save was never reported"
        time.sleep(0.005)
        done = w.get_finished(set())[0] or set()


def _load(w, req_id, keys, pages):
    """One synchronous load, as start_load_kv runs it before the forward."""
    w.start_load_kv(UCMConnectorMetadata(loads=[LoadJob(req_id, keys, pages, False)]))


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("layout", ["cpu", "flash_attn", "flashinfer", "block_outermost", "heads_outermost"])
def test_save_then_load_into_other_pages_reproduces_them(layout, path):
    kv = _kv(layout)
    w, cache = _worker(kv, path)
    before = {n: kv[n][0].clone() for n in NAMES}
    a, b, c = b"A" * 16, b"B" * 16, b"C" * 16
    _save(w, "r1", [a, b, c], [[1, 2], [3, 4], [5, 6]])
    for key, pages in ((a, (1, 2)), (b, (3, 4))):
        t_page = [(kv[n][0], kv[n][2]) for n in NAMES]
        assert cache.blob(key) == b"".join(page(t, p) for t, page in t_page for p in pages)

    cache.lost.add(c)
    _load(w, "r2", [a, b, c], [[SKIP, 7], [8, 9], [0, 1]])
    for n in NAMES:
        t, dim, _ = kv[n]
        for dst, src in ((7, 2), (8, 3), (9, 4)):
            assert torch.equal(t.select(dim, dst), before[n].select(dim, src)), (n, dst)
        for q in (0, 1, 2, 3, 4, 5, 6):  # SKIP, lost block, untouched pages
            assert torch.equal(t.select(dim, q), before[n].select(dim, q)), (n, q)
    assert w.get_block_ids_with_load_errors() == {0, 1}
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    w.shutdown()


def test_both_copy_paths_write_the_same_payload():
    kv = _kv("flash_attn")
    blobs = []
    for path in ("native", "torch"):
        w, cache = _worker(kv, path)
        _save(w, "r", [b"A" * 16, b"B" * 16], [[4, 1], [9, 3]])
        blobs.append([cache.blob(k) for k in (b"A" * 16, b"B" * 16)])
        w.shutdown()
    assert blobs[0] == blobs[1]


def test_torch_copier_lets_go_of_an_arena_replaced_by_a_new_one():
    """After a service restart the client maps a new arena: the copier takes
    it and releases the old one (on CUDA: unregisters it) once unused."""
    kv = _kv("cpu")
    made = []
    w = UCMWorkerSide(FakeCache(), pages_per_block=PPB, num_kv_blocks=B,
                      copier_factory=lambda *a: made.append(TorchPageCopier(*a)) or made[-1])
    w.register_kv_caches({n: kv[n][0] for n in NAMES})
    [copier] = made
    old, new = bytearray(1 << 20), bytearray(1 << 20)
    blocks = [(0, [1, 2])]
    copier.copy(True, blocks, old)
    with pytest.raises(BufferError):
        old.extend(b"x")  # still exported: the copier holds it as the current arena
    copier.copy(True, blocks, new)
    old.extend(b"x")  # released
    assert bytes(new[:w.block_bytes]) == bytes(old[:w.block_bytes])
    w.shutdown()
    new.extend(b"x")  # shutdown releases the current one too


def test_refuses_a_layout_without_contiguous_page_chunks():
    kv = {n: torch.zeros(B, 2, 16, 128)[..., ::2] for n in NAMES}
    w = UCMWorkerSide(FakeCache(), pages_per_block=PPB, num_kv_blocks=B)
    with pytest.raises(ConfigError,
                       match=r"model.layers.0.self_attn.attn.*\(10, 2, 16, 64\).*\(4096, 2048, 128, 2\)"):
        w.register_kv_caches(kv)
    w.shutdown()


def test_a_block_payload_is_each_layers_pages_in_order_on_the_cpu_backends_layout():
    """vLLM's CPU backend: [num_blocks, heads, 128-token page, K|V] bf16
    per layer, registered out of layer order; without a KVCacheConfig the
    first dimension indexes pages."""
    cache = FakeCache()
    w = UCMWorkerSide(cache, pages_per_block=2)
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]
    kv = {n: torch.randn(10, 3, 128, 128).to(torch.bfloat16) for n in names}
    before = {n: t.clone() for n, t in kv.items()}
    w.register_kv_caches(kv)
    assert w.block_bytes == 3 * 2 * (3 * 128 * 128 * 2)
    a, b = b"A" * 16, b"B" * 16
    _save(w, "r1", [a, b], [[1, 2], [3, 4]])
    layer = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    expect = b"".join(before[n][p].contiguous().view(torch.uint8).numpy().tobytes() for n in layer for p in (1, 2))
    assert cache.blob(a) == expect

    cache.lost.add(b)
    _load(w, "r2", [a, b], [[SKIP, 6], [7, 8]])
    for n in names:
        assert torch.equal(kv[n][6], before[n][2])  # second page of block A
        assert torch.equal(kv[n][5], before[n][5])  # SKIP: untouched
    assert w.get_block_ids_with_load_errors() == {7, 8}
    w.shutdown()


def test_loads_and_saves_carry_their_request_id():
    kv = _kv("cpu")
    w, cache = _worker(kv, "native")
    _save(w, "req-7", [b"A" * 16], [[1, 2]])
    _load(w, "req-8", [b"A" * 16], [[3, 4]])
    w.shutdown()
    assert cache.slot_calls == [("write", "req-7"), ("read", "req-8")]


@pytest.mark.parametrize("broken", ["read_slots", "write_slots"])
def test_a_cache_that_raises_loses_blocks_and_never_raises_into_vllm(broken):
    kv = _kv("cpu")
    w, cache = _worker(kv, "native")
    before = {n: kv[n][0].clone() for n in NAMES}
    cache.broken.add(broken)
    _save(w, "r1", [b"A" * 16], [[1, 2]])  # still reported in finished_sending
    _load(w, "r2", [b"A" * 16], [[3, 4]])
    w.shutdown()
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.counters["stored_blocks"] == (1 if broken == "read_slots" else 0)
    assert w.counters["loaded_blocks"] == 0
    for n in NAMES:
        assert torch.equal(kv[n][0], before[n])


@pytest.mark.parametrize("layout", ["cpu", "flash_attn", "heads_outermost"])
def test_the_cpu_backend_layout_is_registered_and_names_the_k_and_v_bytes(layout):
    """On vLLM's CPU layout the worker registers a KvLayout whose K rows are
    the first page_tokens rows of each head of each page and V the next
    (the backend's view `[.., heads, 2 * page_tokens, head_size]`); other
    layouts register an opaque one of the block's size (no lossy codec reads
    their blocks, nor another engine's layout of that size into them)."""
    import numpy as np

    from ucm.codecs.layout import opaque_layout, paged_head_major_layout

    kv = _kv(layout)
    w, cache = _worker(kv, "native")
    if layout != "cpu":
        assert cache.layouts == [opaque_layout(w.block_bytes)]
        return
    t = kv[NAMES[0]][0]  # [B, H, N, 2 * D]
    _, H, N, D2 = t.shape
    assert cache.layouts == [paged_head_major_layout("bfloat16", L, H, PPB, N, D2 // 2)]
    kvl = cache.layouts[0]
    assert kvl.block_bytes == w.block_bytes
    pages = [3, 7]  # the block's pages, in order
    payload = np.frombuffer(b"".join(kv[n][2](kv[n][0], p) for n in NAMES for p in pages), dtype=np.uint16)
    rows = kvl.block_rows() // 2
    k_seg, v_seg = kvl.segments
    per_layer = k_seg.rows + v_seg.rows
    k_rows = rows[:k_seg.rows]  # layer 0's K: head-major, tokens of page 3 then page 7
    v_rows = rows[k_seg.rows:per_layer]
    want_k = t[pages].view(PPB, H, 2 * N, D2 // 2)[:, :, :N].transpose(0, 1).reshape(-1, D2 // 2)
    want_v = t[pages].view(PPB, H, 2 * N, D2 // 2)[:, :, N:].transpose(0, 1).reshape(-1, D2 // 2)
    got_k = payload[k_rows[:, None] + np.arange(D2 // 2)]
    got_v = payload[v_rows[:, None] + np.arange(D2 // 2)]
    assert (got_k == want_k.contiguous().view(torch.uint16).numpy()).all()
    assert (got_v == want_v.contiguous().view(torch.uint16).numpy()).all()
