"""SGLang 0.5.23's HiCache on CPU, for tests only: the two places where it
fails as shipped, replaced by plain torch code; the rest of SGLang's HiCache
(radix tree, controller, storage factory, prefetch and backup threads) runs
unchanged, and nothing on the ucm <-> host-pool path is touched
(`get_page_buffer_meta` and the pool's buffers are SGLang's own).

1. `MHATokenToKVPoolHost` pins its host memory (`_cuda_host_register`:
   "Torch not compiled with CUDA"): constructed with pin_memory=False.
2. Its device<->host copies (`load_to_device_per_layer`,
   `backup_from_device_all_layer`) are bound only for CUDA/HIP/XPU: replaced
   by torch index copies for each layout (`layer_first: buf[layer][idx]`,
   `page_first: buf[idx, layer]`, `page_first_direct:
   buf[idx // page, layer, idx % page]`).

`apply()` refuses (RuntimeError) any SGLang version but the one this was
written against, or patched symbols whose signatures changed; the guard
test (tests/unit/connectors/hicache/test_cpu_shim_guard.py) checks the same.
"""
from __future__ import annotations

import functools
import inspect

SGLANG_VERSION = "0.5.23"
PATCHED = {  # symbol -> its parameters as this shim expects them
    "MHATokenToKVPoolHost.__init__": ["self", "buffer_info", "host_to_device_ratio", "host_size", "page_size",
                                      "layout", "pin_memory", "device", "allocator_type", "device_capacity_tokens",
                                      "start_layer", "end_layer", "draft_buffer_infos", "write_back_staging",
                                      "pool_label", "head_group_num", "host_token_capacity"],
    "MHATokenToKVPoolHost.load_to_device_per_layer": ["self", "device_pool", "host_indices", "device_indices",
                                                      "layer_id", "io_backend", "is_draft"],
    "MHATokenToKVPoolHost.backup_from_device_all_layer": ["self", "device_pool", "host_indices", "device_indices",
                                                          "io_backend"],
}


def mismatches() -> list[str]:
    """What differs from the SGLang this shim was written for (empty: none)."""
    import sglang
    from sglang.srt.mem_cache.pool_host import mha

    out = []
    if sglang.__version__ != SGLANG_VERSION:
        out.append(f"sglang {sglang.__version__} installed, the shim is for {SGLANG_VERSION}")
    for name, params in PATCHED.items():
        cls_name, attr = name.split(".")
        fn = getattr(getattr(mha, cls_name, None), attr, None)
        fn = getattr(fn, "__ucm_original__", fn)
        if fn is None:
            out.append(f"{name} is gone")
        elif list(inspect.signature(fn).parameters) != params:
            out.append(f"{name} now takes {list(inspect.signature(fn).parameters)}")
    return out


def _rows(host, layer: int, idx):
    """Index tuples of tokens `idx` of `layer` in a host K or V buffer."""
    if host.layout == "layer_first":
        return (layer, idx)
    if host.layout == "page_first":
        return (idx, layer)
    if host.layout == "page_first_direct":
        return (idx // host.page_size, layer, idx % host.page_size)
    raise NotImplementedError(f"the CPU shim has no copy for host layout {host.layout!r}")


def _load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                              is_draft=False):
    if is_draft or not 0 <= layer_id < self.target_layer_num:
        return
    h, d = host_indices.long(), device_indices.long().to(self.device_k_buffers[layer_id].device)
    for host_buf, dev_buf in ((self.k_buffer, self.device_k_buffers[layer_id]),
                              (self.v_buffer, self.device_v_buffers[layer_id])):
        dev_buf[d] = host_buf[_rows(self, layer_id, h)].to(dev_buf.device)


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    h, d = host_indices.long(), device_indices.long()
    for layer in range(self.layer_num):
        for host_buf, dev_buf in ((self.k_buffer, self.device_k_buffers[layer]),
                                  (self.v_buffer, self.device_v_buffers[layer])):
            host_buf[_rows(self, layer, h)] = dev_buf[d.to(dev_buf.device)].to(host_buf.device)


def apply() -> None:
    """Patches SGLang's MHA host pool (idempotent); RuntimeError on a
    version or symbol mismatch."""
    from sglang.srt.mem_cache.pool_host import mha

    bad = mismatches()
    if bad:
        raise RuntimeError("tests/sglang_cpu/hicache_cpu_shim.py: " + "; ".join(bad))
    cls = mha.MHATokenToKVPoolHost
    if getattr(cls.__init__, "__ucm_original__", None) is not None:
        return
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        names = PATCHED["MHATokenToKVPoolHost.__init__"][1:]
        if len(args) > names.index("pin_memory"):
            args = list(args)
            args[names.index("pin_memory")] = False
        else:
            kwargs["pin_memory"] = False
        original_init(self, *args, **kwargs)

    __init__.__ucm_original__ = original_init
    cls.__init__ = __init__
    for name, fn in (("load_to_device_per_layer", _load_to_device_per_layer),
                     ("backup_from_device_all_layer", _backup_from_device_all_layer)):
        fn.__ucm_original__ = getattr(cls, name)
        setattr(cls, name, fn)
