"""The worker half of UCMConnector on fake CPU KV tensors in the layouts of
vLLM's CPU, FlashAttention and FlashInfer backends and as strided views into
one buffer: a block's payload is each layer's pages in order, each page its
bytes in memory order (K and V never re-interpreted); a save then a load
into other pages reproduces them exactly; SKIP pages are left alone.

Both copy paths run here: the native one (CPU tensors) and TorchPageCopier
(the path for CUDA tensors) forced onto CPU tensors. The CUDA specifics of
the latter (pinned arena, streams, events) have not been run on a GPU."""
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

import ucm.connectors.vllm as uv  # noqa: E402
from ucm.cache import Outcome  # noqa: E402
from ucm.connectors.torch_pages import TorchPageCopier  # noqa: E402

B, L, PPB = 10, 3, 2  # KV blocks, layers, pages per ucm block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


class MemoryCache:
    """The slot API of CacheClient over a bytearray arena."""

    def __init__(self):
        self.arena = bytearray(1 << 22)
        self.slots, self.lost, self.next = {}, set(), 4096

    def write_slots(self, keys, sizes, fill, parent=None):
        slots = []
        for k, n in zip(keys, sizes):
            slots.append((self.next, n))
            self.slots[k] = (self.next, n)
            self.next += n + 4096
        fill(0, slots, self.arena)
        return [Outcome.DONE] * len(keys)

    def read_slots(self, keys, sizes, fill):
        slots = [self.slots.get(k) if k not in self.lost else None for k in keys]
        fill(0, slots, self.arena)
        return [Outcome.DONE if s else Outcome.MISSING for s in slots]

    def blob(self, k):
        off, n = self.slots[k]
        return bytes(self.arena[off:off + n])


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


def _connector(kv, path):
    conn = object.__new__(uv.UCMConnector)  # worker state only; no vLLM engine
    conn.settings = uv.ConnectorSettings()
    conn.pages_per_block = PPB
    conn._kv_cache_config = SimpleNamespace(num_blocks=B, kv_cache_tensors=[])
    conn._cache = MemoryCache()
    conn._init_worker()
    conn.register_kv_caches({n: kv[n][0] for n in reversed(NAMES)})  # registration order is not layer order
    if path == "torch":
        storages = [torch.empty(0, dtype=torch.uint8).set_(kv[n][0].untyped_storage()) for n in NAMES]
        # A small staging buffer: blocks go through it one at a time.
        conn._copier = TorchPageCopier(storages, conn._layouts, PPB, staging_bytes=1)
    return conn


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("layout", ["cpu", "flash_attn", "flashinfer", "block_outermost", "heads_outermost"])
def test_save_then_load_into_other_pages_reproduces_them(layout, path):
    kv = _kv(layout)
    conn = _connector(kv, path)
    before = {n: kv[n][0].clone() for n in NAMES}
    a, b, c = b"A" * 16, b"B" * 16, b"C" * 16
    conn._pending_saves["r1"] = 1
    conn._saving_reqs.add("r1")
    conn._save(uv.StoreJob("r1", [a, b, c], [[1, 2], [3, 4], [5, 6]], None))
    assert conn.get_finished({"r1"}) == ({"r1"}, None)
    for key, pages in ((a, (1, 2)), (b, (3, 4))):
        t_page = [(kv[n][0], kv[n][2]) for n in NAMES]
        assert conn._cache.blob(key) == b"".join(page(t, p) for t, page in t_page for p in pages)

    conn._cache.lost.add(c)
    conn._load(uv.LoadJob("r2", [a, b, c], [[uv.SKIP, 7], [8, 9], [0, 1]], False))
    for n in NAMES:
        t, dim, _ = kv[n]
        for dst, src in ((7, 2), (8, 3), (9, 4)):
            assert torch.equal(t.select(dim, dst), before[n].select(dim, src)), (n, dst)
        for q in (0, 1, 2, 3, 4, 5, 6):  # SKIP, lost block, untouched pages
            assert torch.equal(t.select(dim, q), before[n].select(dim, q)), (n, q)
    assert conn.get_block_ids_with_load_errors() == {0, 1}
    conn.shutdown()


def test_both_copy_paths_write_the_same_payload():
    kv = _kv("flash_attn")
    blobs = []
    for path in ("native", "torch"):
        conn = _connector(kv, path)
        conn._pending_saves["r"] = 1
        conn._save(uv.StoreJob("r", [b"A" * 16, b"B" * 16], [[4, 1], [9, 3]], None))
        blobs.append([conn._cache.blob(k) for k in (b"A" * 16, b"B" * 16)])
        conn.shutdown()
    assert blobs[0] == blobs[1]


def test_torch_copier_lets_go_of_an_arena_replaced_by_a_new_one():
    """After a service restart the client maps a new arena: the copier takes
    it and releases the old one (on CUDA: unregisters it) once unused."""
    kv = _kv("cpu")
    conn = _connector(kv, "torch")
    copier = conn._copier
    old, new = bytearray(1 << 20), bytearray(1 << 20)
    blocks = [(0, [1, 2])]
    copier.copy(True, blocks, old)
    with pytest.raises(BufferError):
        old.extend(b"x")  # still exported: the copier holds it as the current arena
    copier.copy(True, blocks, new)
    old.extend(b"x")  # released
    assert bytes(new[:conn._block_bytes]) == bytes(old[:conn._block_bytes])
    conn.shutdown()
    new.extend(b"x")  # shutdown releases the current one too


def test_refuses_a_layout_without_contiguous_page_chunks():
    kv = {n: torch.zeros(B, 2, 16, 128)[..., ::2] for n in NAMES}
    conn = object.__new__(uv.UCMConnector)
    conn.settings = uv.ConnectorSettings()
    conn.pages_per_block = PPB
    conn._kv_cache_config = SimpleNamespace(num_blocks=B, kv_cache_tensors=[])
    conn._cache = MemoryCache()
    conn._init_worker()
    with pytest.raises(uv.ConfigError,
                       match=r"model.layers.0.self_attn.attn.*\(10, 2, 16, 64\).*\(4096, 2048, 128, 2\)"):
        conn.register_kv_caches(kv)
    conn.shutdown()


def test_worker_copies_whole_pages_layer_major_and_loads_wait_for_saves():
    """The worker side alone, on fake KV tensors and an in-memory cache: a
    block's payload is each layer's pages in order, byte for byte; a load
    leaves SKIP pages alone and reports the pages of blocks that did not
    arrive."""
    conn = object.__new__(uv.UCMConnector)  # worker state only; no vLLM engine
    conn.settings = uv.ConnectorSettings()
    conn.pages_per_block = 2
    conn._cache = MemoryCache()
    conn._init_worker()
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 1)]  # registration order is not layer order
    kv = {n: torch.randn(10, 3, 128, 128).to(torch.bfloat16) for n in names}
    before = {n: t.clone() for n, t in kv.items()}
    conn.register_kv_caches(kv)
    a, b = b"A" * 16, b"B" * 16
    conn._pending_saves["r1"] = 1
    conn._saving_reqs.add("r1")
    conn._save(uv.StoreJob("r1", [a, b], [[1, 2], [3, 4]], None))
    layer = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    expect = b"".join(before[n][p].contiguous().view(torch.uint8).numpy().tobytes() for n in layer for p in (1, 2))
    assert conn._cache.blob(a) == expect
    assert conn.get_finished({"r1"}) == ({"r1"}, None)

    conn._cache.lost.add(b)
    conn._load(uv.LoadJob("r2", [a, b], [[uv.SKIP, 6], [7, 8]], False))
    for n in names:
        assert torch.equal(kv[n][6], before[n][2])  # second page of block A
        assert torch.equal(kv[n][5], before[n][5])  # SKIP: untouched
    assert conn.get_block_ids_with_load_errors() == {7, 8}
    assert conn.get_block_ids_with_load_errors() == set()

    # A load planned while the same blocks are still being saved (the next
    # turn of a chat right after the last) waits for that save.
    gate = threading.Event()
    write_slots = conn._cache.write_slots

    def slow_write(keys, sizes, fill, parent=None):
        gate.wait(10)
        return write_slots(keys, sizes, fill, parent)

    conn._cache.write_slots = slow_write
    c = b"C" * 16
    conn._connector_metadata = uv.UCMConnectorMetadata(stores=[uv.StoreJob("r3", [c], [[3, 4]], None)])
    conn.wait_for_save()
    threading.Timer(0.3, gate.set).start()
    conn._load(uv.LoadJob("r4", [c], [[8, 9]], True))
    for n in names:  # the block was there: the load waited for its save
        assert torch.equal(kv[n][8], before[n][3]) and torch.equal(kv[n][9], before[n][4])
    assert conn.get_block_ids_with_load_errors() == set()
    conn.shutdown()
