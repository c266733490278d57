"""UCMConnector: ucm as a vLLM v1 KV connector (KVConnectorBase_V1).

Loaded by vLLM with

    --kv-transfer-config '{"kv_connector":"UCMConnector",
        "kv_connector_module_path":"ucm.connectors.vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"ucm_config":"configs/default.yaml"}}'

Set `kv_load_failure_policy` to "recompute": with vLLM's default ("fail") a
block that vanished between lookup and load fails the request instead of
being recomputed.

vLLM builds two instances, and `UCMConnector` only delegates by role, as
vLLM's own OffloadingConnector does:
- SCHEDULER (engine-core process): `scheduler.UCMSchedulerSide` keys the
  prompt's full blocks under the engine's namespace (`namespace`), looks
  them up and pins the hit, and plans per step which blocks workers load
  and save (`metadata.UCMConnectorMetadata`). Short control calls to the
  cache only, never payload copies. Requests still waiting for vLLM's
  pages pin at most `ucm_max_waiting_pin_bytes` in all (default a quarter
  of the landing tier; the only waiting request pins its whole hit); hits
  beyond are misses until there is room. A pin keeps a block cached, not
  in DRAM: a hit longer than DRAM stages chunk by chunk.
- WORKER (each worker process): `worker.UCMWorkerSide` copies whole vLLM
  pages, every layer, verbatim between vLLM's paged KV tensors and the
  cache's arena slots (`CacheAPI.read_slots` / `write_slots`). Synchronous
  loads (blocks in DRAM) run in start_load_kv before the forward and never
  wait for a save in flight; asynchronous loads (blocks below DRAM, or
  still being saved) and all saves run in the background and are reported
  through get_finished. A save holds the request's pages until reported; a
  preemption takes them back at once. A step whose synchronous load missed
  blocks saves nothing of that request (its forward ran over pages that did
  not load). Loads that fail are reported through
  get_block_ids_with_load_errors so vLLM recomputes those pages.
- A block whose save is planned but not yet done still counts as a hit for
  a request that arrives meanwhile (the next turn of a chat): it is loaded
  asynchronously, after that save.
- Blended prefills (retrieved passages reused wherever they sit): a request
  whose `kv_transfer_params` declare `ucm_chunks` has its first tokens
  filled by the worker's `VllmBlender` (blend.py) in `start_load_kv`, when
  vLLM runs with `worker_cls` `blend_worker.UcmCPUWorker` (which hands the
  connector the model, `bind_model`); blend_request.py says which requests
  qualify. A blend that fails is a load error: vLLM recomputes.

The cache is any `ucm.api.CacheAPI`. By default each instance opens a
client of the node's ucm service (`open_cache`; on CPU the scheduler and
the worker are separate processes, EngineCore subprocess and
MultiprocExecutor worker, so they must share a service); code that builds
the connector itself (tests, an embedding with both roles in one process)
passes `cache=`, e.g. an in-process `UnifiedCache`, and keeps ownership of
it. The scheduler begins each request in the cache (`begin_request`) and
finishes it there; the worker's loads and saves carry its `request_id`.

Nothing here raises into vLLM for a cache fault: a dead service or a lost
block is a miss. Only bad configuration raises, at construction.

Limits of this version: tensor and pipeline parallel size 1, one KV cache
group (no hybrid allocator), no multimodal or prompt-embeds requests (they
are neither looked up nor saved), prompt blocks only (decode output is not
saved). KV tensors on CPU or one CUDA device, in any layout where one
dimension of size num_blocks indexes pages and a page is made of contiguous
chunks (refused at register_kv_caches otherwise, or when several
dimensions have that size and the engine's block stride does not tell them
apart); attention kernels that split a page into smaller kernel blocks are
refused. Run end to end on the CPU backend only: the CUDA copy path
(`torch_pages.TorchPageCopier`: pinning, streams, events) ran on an H200
outside vLLM (tests/e2e/test_device_paths.py), not yet under vLLM.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm.api import CacheAPI
from ucm.config.schema import UcmConfig, load_config
from ucm.connectors.kv_pages import SKIP
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata
from ucm.connectors.vllm.namespace import build_namespace, model_identity
from ucm.connectors.vllm.blend import VllmBlender
from ucm.connectors.vllm.blend_request import engine_options
from ucm.connectors.vllm.scheduler import UCMSchedulerSide
from ucm.connectors.vllm.settings import ConnectorSettings, check_engine
from ucm.connectors.vllm.worker import UCMWorkerSide
from ucm.errors import UcmError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SKIP", "ConnectorSettings", "LoadJob", "StoreJob", "UCMConnector", "UCMConnectorMetadata",
           "UCMSchedulerSide", "UCMWorkerSide", "build_namespace", "model_identity", "open_cache"]

log = logging.getLogger(__name__)


def open_cache(config: UcmConfig) -> CacheAPI:
    """The default cache of a connector instance: a client of the node's ucm
    service (a private one is started for `config` when none runs)."""
    import ucm

    return ucm.connect(config)


class UCMConnector(KVConnectorBase_V1):
    """ucm behind vLLM's KV connector API; delegates to a UCMSchedulerSide or
    a UCMWorkerSide by role (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig",
                 cache: Optional[CacheAPI] = None) -> None:
        """`cache`: the cache to use, owned by the caller; None opens a client
        of the node's service (`open_cache`), closed at shutdown."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.config = load_config(self.settings.ucm_config)
        pages_per_block = check_engine(vllm_config, kv_cache_config, self.config.block_tokens)
        self.blend_options = engine_options(self.config)  # a ConfigError for options vLLM cannot blend with
        self._owns_cache = cache is None
        self._cache: CacheAPI = open_cache(self.config) if cache is None else cache
        self._scheduler: Optional[UCMSchedulerSide] = None
        self._worker: Optional[UCMWorkerSide] = None
        self.blender: Optional[VllmBlender] = None  # set by bind_model (blend_worker.UcmCPUWorker)
        self.blend_unsupported = ""  # why bind_model could not build one
        try:
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = UCMSchedulerSide.from_vllm(vllm_config, kv_cache_config, self.config,
                                                             self.settings, self._cache)
            else:
                self._worker = UCMWorkerSide.from_vllm(kv_cache_config, pages_per_block, self.settings,
                                                       self._cache)
        except BaseException:
            self._close_cache()
            raise

    @property
    def scheduler_side(self) -> UCMSchedulerSide:
        if self._scheduler is None:
            raise UcmError(f"UCMConnector: a scheduler-side call on the {self.role.name} instance")
        return self._scheduler

    @property
    def worker_side(self) -> UCMWorkerSide:
        if self._worker is None:
            raise UcmError(f"UCMConnector: a worker-side call on the {self.role.name} instance")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, nothing more

    # ---- scheduler side (engine-core process) --------------------------------------
    def on_new_request(self, request: "Request") -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.scheduler_side.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        return self.scheduler_side.get_external_cache_hit_sources(request, num_external_tokens)

    def take_events(self) -> list:
        """The blocks ucm holds, as KV events in vLLM's stream (kv_events.py)."""
        return self.scheduler_side.take_events() if self._scheduler is not None else []

    # ---- worker side (worker process) ------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def bind_model(self, model: torch.nn.Module) -> None:
        """The worker's model, for blended prefills (blend.py); called by
        `blend_worker.UcmCPUWorker` once the connector exists. A model
        blending does not support is logged, and its blended requests are
        recomputed by vLLM."""
        try:
            self.blender = VllmBlender(model, self._vllm_config, self._kv_cache_config, self._cache,
                                       self.blend_options)
        except UcmError as exc:
            self.blend_unsupported = str(exc)
            log.warning("UCMConnector: blended requests will be computed in full: %s", exc)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        self.worker_side.start_load_kv(meta)
        for job in getattr(meta, "blends", ()):
            try:
                if self.blender is None:
                    raise UcmError(self.blend_unsupported or "no model: vLLM's worker_cls is not UcmCPUWorker")
                self.blender.blend(job)
            except Exception:  # never into vLLM: its pages are load errors, and vLLM computes the request
                log.warning("UCMConnector: blending request %s failed; vLLM computes it", job.req_id, exc_info=True)
                self.worker_side.add_load_errors(job.blended_pages(self._vllm_config.cache_config.block_size))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)  # streamed loads; the others finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    # ---- both ---------------------------------------------------------------------
    def shutdown(self) -> None:
        try:
            for side in (self._scheduler, self._worker):
                if side is not None:
                    side.shutdown()  # a worker's saves in flight finish first
        finally:
            self._close_cache()

    def _close_cache(self) -> None:
        if self._owns_cache:
            self._owns_cache = False
            try:
                self._cache.close()
            except Exception:
                log.debug("closing the cache client failed", exc_info=True)
