"""UCMStorage: ucm as an SGLang HiCache storage backend (GPU -> host -> ucm).

Loaded by SGLang as a dynamic backend, no patch to SGLang:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"ucm",
        "module_path":"ucm.connectors.sglang","class_name":"UCMStorage",
        "interface_v1":1,"ucm_config":"configs/default.yaml"}'

`interface_v1` is required: SGLang then moves pages with `batch_set_v1` /
`batch_get_v1` straight between its host pool and ucm's shared-memory arena
(`host_pages.HostPageCopier`); the copying `get` / `set` of the legacy
interface are not served. Extra-config keys (`ucm_*`, see `StorageSettings`):
`ucm_config` (a YAML path or an inline mapping; default `$UCM_CONFIG` or
the built-in defaults), `ucm_model_id` (names the model in block keys
instead of a fingerprint of the weights), `ucm_copy_threads`. Adding
`"hicache_storage_pass_prefix_keys": true` lets SGLang tell the backend the
page before each batch, so a batch that continues a cached prefix is stored
as its child (the parent chain placement keeps); without it such a batch
starts a new chain.

Who runs what: SGLang's `StorageBackendFactory` builds the backend in the
scheduler process (`cls(storage_config, kwargs)`) and registers its host
pool (`register_mem_pool_host`: the namespace and the copier are built
there, once). `batch_exists` runs in the prefetch thread, `batch_get_v1` in
the prefetch IO thread, `batch_set_v1` in the backup thread, concurrently;
the cache is any `ucm.api.CacheAPI` (thread-safe), by default a client of
the node's ucm service (`ucm.connect`, a private one when none runs), so
vLLM and SGLang processes on one node share one cache.

Pages and blocks: one ucm block is one SGLang page (`--page-size` tokens,
all layers of this rank's pool), keyed by `namespace.page_keys` under the
pool's namespace (model weights, KV dtype, layout, page size, TP/PP rank).
`batch_exists` answers the leading pages present from the service's shared
key index, without a socket round trip.

Faults: nothing here raises into SGLang's threads for a cache fault; a dead
service, a lost or corrupt block, a failed copy is `False` for that page
(and `batch_exists` a shorter prefix), logged. Only bad configuration raises,
at construction or registration.

Limits of this version: MHA pools (`MHATokenToKVPoolHost`) in the layouts
`layer_first`, `page_first` and `page_first_direct`; no MLA, no context
parallel, no split heads (`tp_lcm_size`), no v2 (hybrid pool) interface.
Run end to end on SGLang for CPU only (with a test-tree shim for SGLang's
own device<->host copies, which SGLang binds only for CUDA/HIP/XPU); the
ucm <-> host-pool path is the same on every device (host memory).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from ucm.api import CacheAPI, Outcome
from ucm.codecs.layout import opaque_layout
from ucm.config.schema import UcmConfig, load_config
from ucm.connectors.sglang.host_pages import HostPageCopier
from ucm.connectors.sglang.namespace import PoolGeometry, build_namespace, model_identity, page_keys
from ucm.errors import ConfigError
from ucm.keys import Namespace

__all__ = ["HostPageCopier", "PoolGeometry", "StorageSettings", "UCMStorage", "build_namespace",
           "model_identity", "page_keys"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """What the backend reads from SGLang's storage extra config."""

    ucm_config: Union[None, str, Mapping[str, Any]] = None  # YAML path or mapping; None: $UCM_CONFIG/defaults
    model_id: Optional[str] = None  # names the model in block keys (default: a fingerprint of the weights)
    copy_threads: int = 1  # native threads per host-pool <-> arena copy

    def __post_init__(self) -> None:
        t = self.copy_threads
        if not (isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= 64):
            raise ConfigError(f"hicache extra config ucm_copy_threads must be an int in 1..64, got {t!r}")
        if self.model_id is not None and not (isinstance(self.model_id, str) and self.model_id):
            raise ConfigError(f"hicache extra config ucm_model_id must be a non-empty string, got {self.model_id!r}")

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "StorageSettings":
        """The settings in `extra`; keys without the `ucm_` prefix belong to
        SGLang and are ignored, unknown `ucm_` keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in (extra or {}).items():
            if not k.startswith("ucm_"):
                continue
            name = k if k == "ucm_config" else k[len("ucm_"):]
            if name not in known:
                raise ConfigError(f"hicache extra config: unknown key {k!r}; allowed: "
                                  f"{sorted(n if n == 'ucm_config' else 'ucm_' + n for n in known)}")
            kwargs[name] = v
        return cls(**kwargs)


def open_cache(config: UcmConfig) -> CacheAPI:
    """The default cache of a backend: a client of the node's ucm service
    (a private one is started for `config` when none runs)."""
    import ucm

    return ucm.connect(config)


def engine_model_identity(storage_config: HiCacheStorageConfig) -> str:
    """The model identity of the running SGLang engine: a fingerprint of the
    weights at its `--model-path` (with revision, dtype, quantization), read
    from SGLang's server args; without them (a backend built outside a
    server), of `storage_config.model_name` taken as a path or hub id."""
    args = None
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:
        log.debug("UCMStorage: no SGLang server args in this process", exc_info=True)
    if args is not None and getattr(args, "model_path", None):
        return model_identity(args.model_path, revision=getattr(args, "revision", None),
                              dtype=str(getattr(args, "dtype", None)),
                              quantization=getattr(args, "quantization", None))
    if not storage_config.model_name:
        raise ConfigError("UCMStorage: neither SGLang's server args nor storage_config.model_name name the model; "
                          "set ucm_model_id in the hicache extra config")
    return model_identity(storage_config.model_name)


class UCMStorage(HiCacheStorage):
    """ucm behind SGLang's HiCacheStorage (interface_v1); see the module doc."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Mapping[str, Any]] = None,
                 cache: Optional[CacheAPI] = None) -> None:
        """As SGLang's factory calls it: `storage_config` (its `extra_config`
        carries the `ucm_*` keys), `kwargs` the factory's extra arguments
        (unused). `cache`: the cache to use, owned by the caller; None opens
        a client of the node's service, closed by `close`."""
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ConfigError("UCMStorage copies pages zero-copy and needs \"interface_v1\": 1 in "
                              "--hicache-storage-backend-extra-config")
        if storage_config.is_mla_model or storage_config.attn_cp_size > 1 or storage_config.should_split_heads:
            raise ConfigError(f"UCMStorage supports MHA models without context parallelism or split heads for now "
                              f"(is_mla_model={storage_config.is_mla_model}, attn_cp_size="
                              f"{storage_config.attn_cp_size}, should_split_heads={storage_config.should_split_heads})")
        self.settings = StorageSettings.from_extra(extra)
        self.config = load_config(self.settings.ucm_config)
        self.storage_config = storage_config
        self.model_id = self.settings.model_id or engine_model_identity(storage_config)
        self.namespace: Optional[Namespace] = None
        self._seed: Optional[bytes] = None
        self._copier: Optional[HostPageCopier] = None
        self._owns_cache = cache is None
        self._cache: CacheAPI = open_cache(self.config) if cache is None else cache

    @property
    def copier(self) -> Optional[HostPageCopier]:
        """The host pool's page copier, once a pool was registered."""
        return self._copier

    # ---- registration (scheduler process, once) -------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Builds the namespace and the copier of SGLang's host pool."""
        super().register_mem_pool_host(mem_pool_host)
        sc = self.storage_config
        geometry = PoolGeometry.of_host_pool(mem_pool_host)
        copier = HostPageCopier(mem_pool_host, self.settings.copy_threads)
        ns = build_namespace(geometry, self.model_id, tp_rank=sc.tp_rank, tp_size=sc.tp_size,
                             pp_rank=sc.pp_rank, pp_size=sc.pp_size)
        self.namespace, self._seed, self._copier = ns, ns.digest(), copier  # published together
        try:  # SGLang's K/V order is not described: lossy codecs must never read these pages
            self._cache.register_layout(opaque_layout(copier.page_bytes))
        except Exception:  # a cache fault: nothing to register with, never an error into SGLang
            log.warning("UCMStorage: registering the page layout failed", exc_info=True)
        log.info("UCMStorage: %s pages of %d tokens, %d bytes each, namespace %s (model %s)",
                 geometry.layout, geometry.page_size, copier.page_bytes, self._seed.hex(), self.model_id)

    # ---- interface_v1 (SGLang's storage threads) --------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading pages of `keys` held anywhere in ucm (0 on any fault)."""
        seed = self._seed
        if seed is None or not keys:
            return 0
        try:
            return int(self._cache.lookup(page_keys(seed, keys)))
        except Exception:
            log.exception("UCMStorage: batch_exists failed; reporting a miss")
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Copies each page from its arena slot into the host pool at
        `host_indices` (page_size slots per key); True per page copied."""
        return self._transfer(False, keys, host_indices, extra_info)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Copies each page from the host pool into a reserved arena slot and
        commits it; True per page cached (now, or already)."""
        return self._transfer(True, keys, host_indices, extra_info)

    def _transfer(self, store: bool, keys: List[str], host_indices: torch.Tensor,
                  extra_info: Optional[HiCacheStorageExtraInfo]) -> List[bool]:
        n = len(keys)
        seed, copier = self._seed, self._copier
        if not n:
            return []
        if seed is None or copier is None:
            log.warning("UCMStorage: %s before a host pool was registered", "batch_set_v1" if store else "batch_get_v1")
            return [False] * n
        try:
            if host_indices.numel() != n * copier.page_size:
                log.error("UCMStorage: %d keys but %d host indices (page size %d)", n, host_indices.numel(),
                          copier.page_size)
                return [False] * n
            indices = host_indices if host_indices.device.type == "cpu" else host_indices.cpu()
            ukeys = page_keys(seed, keys)
            sizes = [copier.page_bytes] * n

            def fill(first: int, slots: list, arena: Any) -> None:
                copier.copy(store, indices, first, slots, arena)

            if store:
                prefix = extra_info.prefix_keys if extra_info is not None else None
                parent = page_keys(seed, prefix[-1:])[0] if prefix else None
                out = self._cache.write_slots(ukeys, sizes, fill, parent=parent)
            else:
                out = self._cache.read_slots(ukeys, sizes, fill)
            bad = [o for o in out if o is not Outcome.DONE]
            if bad:
                log.debug("UCMStorage: %s: %d of %d pages not %s (%s)", "set" if store else "get", len(bad), n,
                          "stored" if store else "loaded", sorted({o.value for o in bad}))
            return [o is Outcome.DONE for o in out]
        except Exception:
            log.exception("UCMStorage: %s failed; reporting %d pages as not done", "batch_set_v1" if store
                          else "batch_get_v1", n)
            return [False] * n

    # ---- the legacy interface: not served (interface_v1 is required) -------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> None:
        log.warning("UCMStorage: the copying get() is not served; use interface_v1")
        return None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[None]:
        log.warning("UCMStorage: the copying batch_get() is not served; use interface_v1")
        return [None] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        log.warning("UCMStorage: the copying set() is not served; use interface_v1")
        return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        log.warning("UCMStorage: the copying batch_set() is not served; use interface_v1")
        return False

    def clear(self) -> bool:
        """Not done: the ucm cache is shared by every engine on the node."""
        log.warning("UCMStorage: clear() ignored; the ucm cache is shared by the node's engines "
                    "(restart its service with empty tiers to empty it)")
        return False

    def get_stats(self) -> None:
        return None  # ucm's counters are in `ucm inspect` and its Prometheus endpoint

    def close(self) -> None:
        if self._owns_cache:
            self._owns_cache = False
            try:
                self._cache.close()
            except Exception:
                log.debug("closing the cache client failed", exc_info=True)
