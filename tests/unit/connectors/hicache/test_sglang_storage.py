"""UCMStorage against SGLang's real MHATokenToKVPool / MHATokenToKVPoolHost
(pin_memory=False) in each of the three layouts, built by SGLang's real
StorageBackendFactory as a dynamic backend with interface_v1, over an
in-process ucm service (ucm.connect's private one), no engine, no shim."""

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from ucm.connectors.sglang import UCMStorage  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE, LAYERS, HEADS, DIM = 16, 3, 2, 8


def ucm_config(tmp_path, name):
    return {"block_tokens": PAGE, "tiers": [{"adapter": "dram", "capacity": "64MiB",
                                             "options": {"prefault": False}}],
            "policy": {"name": "lru"},
            "service": {"name": name, "socket": str(tmp_path / f"{name}.sock")}}


def pools(layout, tokens=512):
    kv = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, HEADS, DIM, LAYERS, device="cpu",
                          enable_memory_saver=False, start_layer=0, end_layer=LAYERS)
    host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)
    return kv, host


def storage_config(extra, tp_rank=0, tp_size=1):
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="smollm2-test", extra_config=extra)


def extra(cfg, **more):
    return {"backend_name": "ucm", "module_path": "ucm.connectors.sglang", "class_name": "UCMStorage",
            "interface_v1": 1, "ucm_config": cfg, "ucm_model_id": "test-model", **more}


def make_backend(host, cfg, **more):
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra(cfg, **more)), host)
    backend.register_mem_pool_host(host)  # as SGLang's cache controller does after creating it
    return backend


def page_hashes(tokens):
    return get_hash_str(tokens, None, page_size=PAGE)


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 49152, (8 * PAGE,), generator=g).tolist()


def fill_random(host, idx):
    g = torch.Generator().manual_seed(int(idx[0]))
    flat = host.kv_buffer.view(-1).view(torch.int16)
    flat.copy_(torch.randint(-2000, 2000, flat.shape, generator=g, dtype=torch.int16))


def page_bytes(host, idx):
    """The host pool's bytes of the pages at `idx`, read through SGLang's own
    per-layout indexing."""
    k, v = host.k_buffer, host.v_buffer
    if host.layout == "layer_first":
        return torch.stack([k[:, idx], v[:, idx]])
    if host.layout == "page_first":
        return torch.stack([k[idx], v[idx]])
    return torch.stack([k[idx // PAGE, :, idx % PAGE], v[idx // PAGE, :, idx % PAGE]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_set_zero_get_into_other_slots_is_bit_exact(tmp_path, layout, tokens):
    _, host = pools(layout)
    backend = make_backend(host, ucm_config(tmp_path, f"sgl-{layout}"))
    try:
        assert type(backend).__name__ == "UCMStorage"
        keys = page_hashes(tokens)
        src = host.alloc(len(tokens))
        fill_random(host, src)
        expect = page_bytes(host, src).clone()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, src) == [True] * len(keys)
        assert backend.batch_exists(keys) == len(keys)
        assert backend._cache.stats()["stored_blocks"] >= len(keys)
        host.kv_buffer.zero_()
        dst = host.alloc(len(tokens))  # other slots than the source's
        assert not torch.equal(dst, src)
        assert backend.batch_get_v1(keys, dst) == [True] * len(keys)
        assert torch.equal(page_bytes(host, dst).view(torch.int16), expect.view(torch.int16))
        # The same tokens under another layout's namespace never hit.
        other = "page_first" if layout != "page_first" else "layer_first"
        _, host2 = pools(other)
        b2 = make_backend(host2, ucm_config(tmp_path, f"sgl-{layout}"))
        assert b2.batch_exists(keys) == 0
        b2.close()
    finally:
        backend.close()


def test_prefix_semantics_first_token_and_missing_middle_page(tmp_path, tokens):
    _, host = pools("page_first")
    backend = make_backend(host, ucm_config(tmp_path, "sgl-prefix"))
    try:
        keys = page_hashes(tokens)
        src = host.alloc(len(tokens))
        fill_random(host, src)
        # Store pages 0-2 and 4-7: page 3 missing.
        assert all(backend.batch_set_v1(keys[:3], src[:3 * PAGE]))
        # A batch told its parent (page 3) is refused while that parent is not
        # cached: ucm never stores a child without its parent.
        orphan = HiCacheStorageExtraInfo(prefix_keys=keys[:4])
        assert backend.batch_set_v1(keys[4:], src[4 * PAGE:], orphan) == [False] * 4
        # Without prefix keys it starts a chain of its own.
        assert all(backend.batch_set_v1(keys[4:], src[4 * PAGE:]))
        # A batch whose parent is cached continues the chain.
        assert all(backend.batch_set_v1(keys[1:3], src[PAGE:3 * PAGE], HiCacheStorageExtraInfo(prefix_keys=keys[:1])))
        assert backend.batch_exists(keys) == 3
        assert backend.batch_exists(keys[4:]) == 4
        changed = page_hashes([tokens[0] + 1] + tokens[1:])
        assert backend.batch_exists(changed) == 0
        # Another model id, or a cache_salt-seeded chain: no hit.
        other = make_backend(host, ucm_config(tmp_path, "sgl-prefix"), ucm_model_id="another-model")
        assert other.batch_exists(keys) == 0
        other.close()
        salted = get_hash_str(tokens, "ab" * 32, page_size=PAGE)
        assert backend.batch_exists(salted) == 0
        # A get of a missing page is False, the pages before it True.
        dst = host.alloc(4 * PAGE)
        assert backend.batch_get_v1(keys[:4], dst) == [True, True, True, False]
    finally:
        backend.close()


def test_another_tp_rank_is_another_namespace(tmp_path, tokens):
    _, host = pools("layer_first")
    cfg = ucm_config(tmp_path, "sgl-tp")
    b0 = UCMStorage(storage_config(extra(cfg), tp_rank=0, tp_size=2), {})
    b1 = UCMStorage(storage_config(extra(cfg), tp_rank=1, tp_size=2), {})
    try:
        for b in (b0, b1):
            b.register_mem_pool_host(host)
        keys = page_hashes(tokens)
        idx = host.alloc(len(tokens))
        assert all(b0.batch_set_v1(keys, idx))
        assert b0.batch_exists(keys) == len(keys) and b1.batch_exists(keys) == 0
    finally:
        b0.close()
        b1.close()


def test_bad_configuration_raises_at_construction(tmp_path):
    cfg = ucm_config(tmp_path, "sgl-bad")
    with pytest.raises(ConfigError, match="interface_v1"):
        UCMStorage(storage_config({**extra(cfg), "interface_v1": 0}), {})
    with pytest.raises(ConfigError, match="ucm_nope"):
        UCMStorage(storage_config(extra(cfg, ucm_nope=1)), {})


def test_a_dead_service_is_a_miss_not_an_exception(tmp_path, tokens):
    _, host = pools("page_first_direct")
    backend = make_backend(host, ucm_config(tmp_path, "sgl-dead"))
    keys = page_hashes(tokens)
    idx = host.alloc(len(tokens))
    assert all(backend.batch_set_v1(keys, idx))
    proc = backend._cache.spawned
    proc.kill()
    proc.wait(10)
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, idx) == [False] * len(keys)
        assert backend.batch_set_v1(keys, idx) == [False] * len(keys)
        assert backend.batch_get_v1(keys, idx[:PAGE]) == [False] * len(keys)  # wrong index count
    finally:
        backend.close()


def test_sglang_failure_injector_no_crash_and_right_types(tmp_path, tokens, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    _, host = pools("layer_first")
    backend = make_backend(host, ucm_config(tmp_path, "sgl-inject"))
    try:
        assert type(backend).__name__ == "HiCacheStorageFailureInjector"
        keys = page_hashes(tokens)
        idx = host.alloc(len(tokens))
        for _ in range(20):
            n = backend.batch_exists(keys)
            assert isinstance(n, int) and 0 <= n <= len(keys)
            for out in (backend.batch_set_v1(keys, idx), backend.batch_get_v1(keys, idx)):
                assert isinstance(out, list) and len(out) == len(keys) and all(type(x) is bool for x in out)
    finally:
        backend._backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_register_an_opaque_layout_so_no_lossy_codec_reads_them(tmp_path, layout):
    """SGLang's K/V order inside a page is not described to ucm: the backend
    registers an opaque layout of its page size, so an int8 tier below DRAM
    stores these pages raw (and never quantises them with another engine's
    layout of the same size)."""
    from ucm.cache.unified import UnifiedCache
    from ucm.codecs.layout import opaque_layout

    _, host = pools(layout)
    cache = UnifiedCache({"block_tokens": PAGE, "tiers": [{"adapter": "dram", "capacity": "64MiB"}]})
    try:
        backend = UCMStorage(storage_config(extra(ucm_config(tmp_path, "sgl-opaque"))), {}, cache=cache)
        backend.register_mem_pool_host(host)
        page = backend._copier.page_bytes
        assert cache.layouts.layouts() == [opaque_layout(page)]
        assert cache.layouts.for_size(page).elem_code is None  # no quantiser reads uint8
    finally:
        cache.close()
