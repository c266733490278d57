"""The CPU shim of tests/sglang_cpu (SGLang's device<->host copies, host
memory pinning) was written against one SGLang version and three symbols:
this fails loudly when either changes, before any e2e test relies on it."""
import pytest

pytest.importorskip("sglang")

import hicache_cpu_shim  # noqa: E402  (tests/sglang_cpu, put on sys.path by conftest)


def test_sglang_version_and_patched_symbols_are_the_ones_the_shim_was_written_for():
    assert hicache_cpu_shim.mismatches() == []


def test_the_shim_touches_nothing_on_the_ucm_host_pool_path():
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    patched = {name.split(".")[1] for name in hicache_cpu_shim.PATCHED}
    assert patched == {"__init__", "load_to_device_per_layer", "backup_from_device_all_layer"}
    assert "get_page_buffer_meta" not in patched
    assert not hasattr(MHATokenToKVPoolHost.get_page_buffer_meta, "__ucm_original__")
