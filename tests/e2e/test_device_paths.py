"""ucm's device paths, on the CPU and on every CUDA device torch sees.

Each test runs on the CPU (so CI checks its logic) and again on `cuda`
where torch sees one. On CUDA they are the only tests of what the CPU
cannot show:
- the vLLM worker's page copier (`TorchPageCopier`) over the service's
  shared arena: the arena registered as pinned memory (cudaHostRegister on
  the service's mmap), copies on ucm's own stream, non-blocking, after the
  event of the forward that wrote the pages;
- the `hbm` tier as device memory, read and written from host buffers and
  device tensors;
- the transformers connector on a model on the device: its hbm front
  (device memory) over the service, and an in-process cache whose hbm tier
  is device memory above DRAM; a hit equals transformers' own prefix reuse
  token for token, the restored KV bit-equal;
- sparse decode with the whole context as budget equal to dense.

The model is a small Llama with random weights (seeded): the paths depend
on shapes and bytes, not on what the weights learnt, and no model file has
to reach the device machine. bfloat16 on CUDA (what engines run), float32
on the CPU.
"""
from __future__ import annotations

import mmap
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_support import TINY, TINY_ID, cold_then_restored, generate, plain, reference, tiny_llama  # noqa: E402
from ucm.api import Outcome  # noqa: E402
from ucm.connectors.kv_pages import SKIP  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device"))]
BT = 16  # tokens per ucm block (transformers tests)
NEW = 6
LAYERS, KV_HEADS, HEAD = TINY["layers"], TINY["kv_heads"], TINY["head"]
MODEL_ID = TINY_ID


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


# ---- the vLLM worker's page copier --------------------------------------------------------------
NUM_PAGES, PAGE_TOKENS, PPB, KV_LAYERS = 12, 16, 2, 3


def _flash_kv(device):
    """Per layer a tensor in vLLM's FlashAttention layout, (2, pages,
    page tokens, KV heads, head size): K and V of a page far apart."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, NUM_PAGES, PAGE_TOKENS, 2, 64, generator=g).to(device=device, dtype=_dtype(device))
            for _ in range(KV_LAYERS)]


def _copier(kv):
    """The copier the worker builds (`UCMWorkerSide.register_kv_caches`)
    for these tensors."""
    from ucm.connectors.torch_pages import TorchPageCopier, page_views

    layouts, _, storages = page_views([(f"layer{i}", t) for i, t in enumerate(kv)], NUM_PAGES)
    return TorchPageCopier(storages, layouts, PPB)


def _page_bytes(t, p):
    """A page's payload: its K bytes then its V bytes, in memory order."""
    return b"".join(t[i, p].cpu().contiguous().view(torch.uint8).numpy().tobytes() for i in (0, 1))


def _payload(kv, pages):
    return b"".join(_page_bytes(t, p) for t in kv for p in pages)


def _blocks(slots, first, page_ids):
    return [(s[0], page_ids[first + i]) for i, s in enumerate(slots) if s is not None]


def _service_config(tmp_path, **extra):
    return {"block_tokens": BT, "service": {"name": f"dev-{os.getpid()}", "socket": str(tmp_path / "ucm.sock")},
            "tiers": [{"adapter": "dram", "capacity": "64MiB", "options": {"prefault": False}}], **extra}


@pytest.mark.parametrize("device", DEVICES)
def test_the_page_copier_saves_and_loads_pages_through_the_services_arena(device, tmp_path):
    import ucm

    kv = _flash_kv(device)
    before = [t.clone() for t in kv]
    copier = _copier(kv)
    keys = [bytes([65 + i]) * 16 for i in range(3)]
    saved, dst = [[1, 2], [3, 4], [5, 6]], [[SKIP, 7], [8, 9], [10, 11]]
    client = ucm.connect(_service_config(tmp_path))
    try:
        ready = copier.record_ready()
        out = client.write_slots(keys, [copier.block_bytes] * 3,
                                 lambda first, slots, arena: copier.copy(True, _blocks(slots, first, saved),
                                                                         arena, ready))
        assert out == [Outcome.DONE] * 3
        got = {}

        def peek(first, slots, arena):
            for i, s in enumerate(slots):
                got[first + i] = bytes(memoryview(arena)[s[0]:s[0] + s[1]])

        assert client.read_slots(keys, [copier.block_bytes] * 3, peek) == [Outcome.DONE] * 3
        assert [got[i] for i in range(3)] == [_payload(kv, pages) for pages in saved]
        if device == "cuda":
            assert [a.registered for a in copier._arenas.values()] == [True]  # pinned: cudaHostRegister took it

        for t in kv:
            t[:, 7:].zero_()
        outcome = client.read_slots(keys, [copier.block_bytes] * 3,
                                    lambda first, slots, arena: copier.copy(False, _blocks(slots, first, dst), arena))
        assert outcome == [Outcome.DONE] * 3
        for t, b in zip(kv, before):
            for d, s in ((7, 2), (8, 3), (9, 4), (10, 5), (11, 6)):
                assert torch.equal(t[:, d], b[:, s]), (d, s)
            assert torch.equal(t[:, :7], b[:, :7])  # block 0's SKIP page and the pages not named: untouched

        # A streamed load copies one layer at a time: only that layer's pages change.
        for t in kv:
            t[:, 8:].zero_()
        client.read_slots(keys[1:2], [copier.block_bytes],
                          lambda first, slots, arena: copier.copy(False, [(slots[0][0], [8, 9])], arena, layers=[1]))
        assert torch.equal(kv[1][:, 8:10], before[1][:, 3:5])
        assert not kv[0][:, 8:].any() and not kv[2][:, 8:].any()
    finally:
        copier.close()
        client.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_save_waits_for_the_forward_that_wrote_its_pages(device):
    """The forward's writes are still queued on the engine's stream when the
    save starts; the copier's stream waits for the event recorded after
    them, so the arena gets the new bytes, not the old."""
    kv = _flash_kv(device)
    copier = _copier(kv)
    arena = mmap.mmap(-1, 4 * copier.block_bytes)
    try:
        if device == "cuda":
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the writes below
        for t in kv:
            t[:, 1:3].fill_(3.0)
        ready = copier.record_ready()
        copier.copy(True, [(copier.block_bytes, [1, 2])], arena, ready)
        want = b"".join(torch.full((PPB, 2, PAGE_TOKENS, 2, 64), 3.0, dtype=_dtype(device)).view(torch.uint8)
                        .numpy().tobytes() for _ in kv)
        assert bytes(arena[copier.block_bytes:2 * copier.block_bytes]) == want
    finally:
        copier.close()
        arena.close()


@pytest.mark.parametrize("device", DEVICES)
def test_the_copier_lets_go_of_an_arena_a_restarted_service_replaced(device):
    kv = _flash_kv(device)
    copier = _copier(kv)
    old, new = bytearray(2 * copier.block_bytes), bytearray(2 * copier.block_bytes)
    copier.copy(True, [(0, [1, 2])], old)
    first = next(iter(copier._arenas.values()))
    assert first.registered == (device == "cuda")
    copier.copy(True, [(0, [1, 2])], new)
    assert first.host is None and not first.registered  # unregistered and released once unused
    old.extend(b"x")  # no export left on it
    assert bytes(new[:copier.block_bytes]) == bytes(old[:copier.block_bytes]) == _payload(kv, [1, 2])
    copier.close()
    new.extend(b"x")


# ---- the hbm tier -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_the_hbm_tier_holds_bytes_from_host_buffers_and_device_tensors(device):
    from ucm.adapters.base import Status
    from ucm.adapters.hbm import HbmAdapter, HbmConfig

    a = HbmAdapter(64 << 10, HbmConfig(device=device))
    assert a.device.type == device and a._pool.device.type == device
    g = torch.Generator().manual_seed(1)
    host = bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g).numpy())
    cpu_t = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=g)
    dev_t = torch.randint(0, 256, (6000,), dtype=torch.uint8, generator=g).to(device)
    k1, k2, k3 = b"1" * 16, b"2" * 16, b"3" * 16
    assert a.put([k1, k2, k3], [host, cpu_t, dev_t]) == [Status.OK] * 3

    out = bytearray(4096)
    assert a.get([k1], [out]) == [Status.OK] and bytes(out) == host
    on_dev = torch.empty(8192, dtype=torch.uint8, device=device)
    assert a.get([k2], [on_dev]) == [Status.OK] and torch.equal(on_dev.cpu(), cpu_t)
    part = torch.empty(1000, dtype=torch.uint8, device=device)
    assert a.get_range([k3], [4000], [part]) == [Status.OK] and torch.equal(part, dev_t[4000:5000])
    host_part = bytearray(100)
    assert a.get_range([k2], [8000], [host_part]) == [Status.OK] and bytes(host_part) == bytes(cpu_t[8000:8100].numpy())

    assert a.get([k1], [bytearray(4095)]) == [Status.CORRUPT]  # not the stored size
    assert a.get_range([k3], [5990], [bytearray(11)]) == [Status.CORRUPT]  # past the end
    assert a.get([b"4" * 16], [bytearray(1)]) == [Status.NOT_FOUND]
    big = torch.zeros(60 << 10, dtype=torch.uint8, device=device)
    assert a.put([b"5" * 16], [big]) == [Status.NO_SPACE]
    assert a.delete([k2]) == [True] and a.put([b"5" * 16], [big[:40 << 10]]) == [Status.OK]



@pytest.mark.parametrize("device", DEVICES)
def test_an_hbm_only_cache_stores_and_loads_device_tensors_in_place(device):
    """The transformers front: a UnifiedCache of one hbm tier takes the
    connector's device tensors as they are; a cache with a host tier
    refuses them (typed error), never reads them as host bytes."""
    from ucm.cache.unified import UnifiedCache
    from ucm.errors import ArgumentError

    g = torch.Generator().manual_seed(2)
    blocks = [torch.randn(2, 3, 16, 8, generator=g).to(device=device, dtype=_dtype(device)) for _ in range(3)]
    keys = [bytes([70 + i]) * 16 for i in range(3)]
    cfg = {"block_tokens": 16, "landing_tier": "hbm",
           "tiers": [{"adapter": "hbm", "capacity": "1MiB", "options": {"device": device}}]}
    with UnifiedCache(cfg) as cache:
        assert cache.store(keys, blocks).wait(10) == [Outcome.DONE] * 3
        for b in blocks:
            b.zero_()  # the cache holds its own copy once the store is done
        out = [torch.empty(2, 3, 16, 8, dtype=_dtype(device), device=device) for _ in range(3)]
        assert cache.load(keys, out).wait(10) == [Outcome.DONE] * 3
        g = torch.Generator().manual_seed(2)
        for o in out:
            assert o.device.type == device
            assert torch.equal(o.cpu(), torch.randn(2, 3, 16, 8, generator=g).to(_dtype(device)))
        assert cache.stats()["bytes_loaded"] == 3 * blocks[0].numel() * blocks[0].element_size()
    if device != "cpu":
        with UnifiedCache({"block_tokens": 16, "tiers": [{"adapter": "dram", "capacity": "1MiB",
                                                          "options": {"prefault": False}}]}) as cache:
            with pytest.raises(ArgumentError, match="only a cache whose every tier is hbm"):
                cache.store(keys, blocks)


# ---- the transformers connector -----------------------------------------------------------------
def _tiny(device):
    return tiny_llama(device, _dtype(device))


def _block_bytes(device):
    return LAYERS * 2 * KV_HEADS * BT * HEAD * torch.tensor([], dtype=_dtype(device)).element_size()


def _tokens(seed, n, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (1, n), generator=g).to(device)


def _plain(model, ids):
    return plain(model, ids, NEW)


def _reference(model, earlier, ids, cached):
    return reference(model, earlier, ids, cached, NEW)


def _generate(conn, ids):
    return generate(conn, ids, NEW)


@pytest.mark.parametrize("front", ["none", "hbm"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_hit_through_the_service_equals_transformers_prefix_reuse(device, front, tmp_path):
    """The service holds the blocks in DRAM; with `hbm`, a front of device
    memory for 2 blocks holds the last ones this process used."""
    import ucm
    from ucm.connectors.transformers import TransformersConnector

    model = _tiny(device)
    doc = _tokens(1, 5 * BT + 3, device)
    a = torch.cat([doc, _tokens(2, 6, device)], 1)
    b = torch.cat([doc, _tokens(3, 9, device)], 1)
    client = ucm.connect(_service_config(tmp_path))
    try:
        conn = TransformersConnector(model, client, model_id=MODEL_ID,
                                     hbm_bytes=0 if front == "none" else 2 * _block_bytes(device) + 4096)
        assert (conn.front is None) == (front == "none")
        if conn.front is not None:
            assert conn.front.adapters[0].device.type == device
        out_ref = cold_then_restored(conn, model, a, b, 5 * BT, NEW)  # restored on the device, bit-equal
        assert conn.stats()["stored_blocks"] == 5
        hit, c1 = _generate(conn, b)
        assert c1.restored_tokens == 5 * BT and torch.equal(hit, out_ref)
        s = conn.stats()
        assert s["load_failed_blocks"] == 0 and s["faults"] == 0
        if front == "hbm":
            assert s["front_hit_blocks"] >= 2
        conn.close()
    finally:
        client.close()


@pytest.mark.parametrize("device", DEVICES)
def test_an_in_process_hbm_tier_on_the_device_demotes_to_dram_and_promotes_back(device):
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector

    model = _tiny(device)
    cfg = {"block_tokens": BT, "landing_tier": "hbm", "policy": {"name": "lru"},
           "tiers": [{"adapter": "hbm", "capacity": 4 * _block_bytes(device) + 4096, "options": {"device": device}},
                     {"adapter": "dram", "capacity": "64MiB", "options": {"prefault": False}}]}
    with UnifiedCache(cfg) as cache:
        assert cache.adapters[0].device.type == device
        conn = TransformersConnector(model, cache, model_id=MODEL_ID)
        assert conn.front is None  # the cache has its own hbm tier
        first = torch.cat([_tokens(20, 3 * BT, device), _tokens(21, 2, device)], 1)
        _, c = _generate(conn, first)
        conn.wait_stores()
        keys = c._rows[0].keys
        assert cache.locate(keys) == ["hbm"] * 3
        _generate(conn, torch.cat([_tokens(22, 3 * BT, device), _tokens(23, 2, device)], 1))
        conn.wait_stores()
        assert "dram" in cache.locate(keys)  # pushed down by the second prompt's blocks
        again = torch.cat([first[:, :3 * BT], _tokens(24, 4, device)], 1)
        out, c = _generate(conn, again)
        assert c.restored_tokens == 3 * BT
        assert torch.equal(out, _reference(model, first, again, 3 * BT)[0])
        conn.wait_stores()
        assert cache.locate(keys) == ["hbm"] * 3
        conn.close()


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_decode_with_the_whole_context_as_budget_equals_dense(device):
    from ucm.accelerators.sparse.base import Budget
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder

    model = _tiny(device)
    ids = _tokens(40, 10 * BT, device)
    dense = _plain(model, ids)
    with UnifiedCache({"block_tokens": BT, "tiers": [{"adapter": "dram", "capacity": "64MiB",
                                                      "options": {"prefault": False}}]}) as cache:
        conn = TransformersConnector(model, cache, model_id=MODEL_ID, hbm_bytes=0)
        dec = SparseDecoder(conn, SparseDecodeConfig(selector="quest", budget=Budget.ratio(1.0),
                                                     sink_tokens=BT, local_tokens=2 * BT))
        with torch.no_grad():
            out = dec.generate(ids, max_new_tokens=NEW, do_sample=False)
        s = dec.stats()
        conn.close()
    assert out[0, ids.shape[1]:].tolist() == dense[0, ids.shape[1]:].tolist()
    assert s["sparse_layer_steps"] == LAYERS * (NEW - 1) and s["dense_fallbacks"] == 0
    assert s["attended_tokens"] == s["context_tokens"] and s["pages_copied"] > 0
