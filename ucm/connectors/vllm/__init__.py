"""UCMConnector: ucm as a vLLM v1 KV connector (KVConnectorBase_V1).

Loaded by vLLM with

    --kv-transfer-config '{"kv_connector":"UCMConnector",
        "kv_connector_module_path":"ucm.connectors.vllm","kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"ucm_config":"configs/default.yaml"}}'

Set `kv_load_failure_policy` to "recompute": with vLLM's default ("fail") a
block that vanished between lookup and load fails the request instead of
being recomputed.

vLLM builds two instances. The SCHEDULER one lives in the engine-core
process: it keys the prompt's full blocks (`ucm.keys.block_keys` under a
namespace built from the model's weights and the KV layout), asks the cache how long a
prefix it holds, and plans per step which blocks workers load and save
(`UCMConnectorMetadata`). The WORKER one lives in the worker process: it
copies whole vLLM pages, every layer, verbatim between vLLM's paged KV
tensors and ucm (payload of one block = for each layer, its pages in order;
K and V are never re-interpreted). On CPU these are separate processes
(EngineCore subprocess + MultiprocExecutor worker), so each instance opens
the cache through `_open_cache`, a client of the per-node service.

Which process runs what, and whether it may block:
- scheduler: get_num_new_matched_tokens (lookup; pins the hit; no other
  side effect, memoised per request), update_state_after_alloc,
  build_connector_meta, update_connector_output, request_finished: short
  control calls to the cache service only, never payload copies. Requests
  still waiting for vLLM's pages pin at most `ucm_max_waiting_pin_bytes`
  in all (default a quarter of the landing tier; the only waiting request
  pins its whole hit); hits beyond are misses until there is room. A pin
  keeps a block cached, not in DRAM: a hit longer than DRAM stages chunk by
  chunk. A step whose synchronous load missed blocks saves nothing of that
  request (its forward ran over pages that did not load).
- worker: start_load_kv blocks for synchronous loads (blocks already in
  DRAM) before the forward, and never waits there for a save in flight;
  asynchronous loads (blocks below DRAM, or still being saved) and all
  saves run on a background thread and are reported through get_finished.
  A save holds the request's pages (request_finished returns True) until the
  worker reports it; a preemption takes them back at once (handle_preemptions
  waits only for a copy in progress; a save not yet copied is dropped, never
  committed). Loads that fail are reported through
  get_block_ids_with_load_errors so vLLM recomputes those pages (and the
  request's next lookup is fresh, so a dead service is not asked again).
- Copies go between vLLM's layer tensors and the arena slots the service
  leases or reserves (CacheClient.read_slots / write_slots). A page is one
  or more contiguous byte chunks of its layer (`kv_pages`; e.g. K then V
  for FlashAttention's (2, num_blocks, ...)); its payload is its chunks in
  memory order. CPU tensors: one native call per layer and chunk, no
  staging buffer. CUDA tensors: `torch_pages.TorchPageCopier` (arena
  registered as pinned memory, a staging buffer on the GPU, non-blocking
  copies on ucm's own streams, saves after an event recorded when the
  forward was queued; each copy is synchronized before its slot is
  committed or released).
- A block whose save is planned but not yet done still counts as a hit for
  a request that arrives meanwhile (the next turn of a chat): it is loaded
  asynchronously, after that save.

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
refused. Run end to end on the CPU backend only: the CUDA path (pinning,
streams, events) has not been run on a GPU; its gather/scatter code is
tested on CPU tensors.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Union

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ucm.config import UcmConfig, load_config
from ucm.connectors.kv_pages import PageLayout, find_page_dim, page_layout
from ucm.errors import ConfigError, CopyAborted
from ucm.keys import Namespace, block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

Key = bytes
SKIP = -1  # a page of a loaded block that vLLM already holds: left alone
PENDING = "pending"  # hit tier of a block whose save is still in flight

_KV_DTYPES = {
    "bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
    "float": "float32", "fp8": "float8_e4m3", "fp8_e4m3": "float8_e4m3", "fp8_e5m2": "float8_e5m2",
}
_LOAD_MODES = ("auto", "sync", "async")


def _open_cache(config: UcmConfig):
    """The cache this process talks to: a client of the node's ucm service
    (a private one is started for `config` when none runs). The scheduler
    and the worker are different processes, so they must share a service."""
    import ucm

    return ucm.connect(config)


# ---- per-step plan shipped from the scheduler to the workers ----------------
@dataclass(slots=True)
class LoadJob:
    """Copy `keys` into the request's pages. `page_ids[i]` lists the vLLM
    pages of block i in order; SKIP marks pages vLLM already computed."""

    req_id: str
    keys: list[Key]
    page_ids: list[list[int]]
    is_async: bool


@dataclass(slots=True)
class StoreJob:
    """Save the pages of consecutive full blocks `keys` (parent of keys[0]
    is `parent`)."""

    req_id: str
    keys: list[Key]
    page_ids: list[list[int]]
    parent: Optional[Key]


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


# ---- worker-side: a background job's hold on its request's pages -----------
class _PagesRevoked(CopyAborted):
    """Raised inside a copy callback when the job's pages were taken back:
    the client then aborts the chunk (a save commits nothing, a load's
    blocks are not DONE)."""


class _PageGuard:
    """A background job's right to touch its request's vLLM pages.

    Copies run inside `pages()`; `revoke()` (handle_preemptions: the pages
    are about to be given to other requests) waits only for a copy in
    progress, a memcpy of at most one client chunk, and makes every later
    `pages()` raise `_PagesRevoked`. So a save either copied its pages
    whole before the preemption or commits nothing, and a load writes no
    page after it. Lock order: a guard's lock, then the worker's `_lock`."""

    __slots__ = ("_lock", "_revoked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked = False

    @property
    def revoked(self) -> bool:
        return self._revoked

    def revoke(self) -> None:
        with self._lock:
            self._revoked = True

    @contextmanager
    def pages(self) -> Iterator[None]:
        with self._lock:
            if self._revoked:
                raise _PagesRevoked("the request was preempted; its pages belong to others now")
            yield


# ---- scheduler-side state ------------------------------------------------
@dataclass(slots=True)
class _ReqState:
    keys: list[Key]  # keys of the prompt's full blocks
    hit_blocks: int = 0  # leading blocks the cache held at lookup
    hit_tiers: list[Optional[str]] = field(default_factory=list)
    looked_up: bool = False
    pinned: list[Key] = field(default_factory=list)
    allocated: bool = False  # vLLM gave it pages (update_state_after_alloc); else it waits
    capped: bool = False  # its hit was cut at the waiting-pin cap: look up again when there is room
    local_tokens: int = 0  # vLLM's own (page-aligned) hit at the last lookup
    load_async: bool = False  # what the last lookup answered vLLM: both sides must agree
    page_ids: list[int] = field(default_factory=list)  # the request's vLLM pages
    next_store: int = 0  # first block neither cached nor planned for saving
    stores_issued: bool = False
    load_failures: int = 0  # loads of this request that lost blocks


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from kv_connector_extra_config."""

    ucm_config: Union[None, str, Mapping[str, Any]] = None  # YAML path or mapping; None: $UCM_CONFIG/defaults
    model_id: Optional[str] = None  # names the model in block keys (default: a fingerprint of the weights)
    load_mode: str = "auto"  # auto: sync from DRAM, async below; or force "sync" / "async"
    load_timeout_s: float = 30.0  # an asynchronous load waits at most this long for saves in flight
    # Bytes that requests still waiting for vLLM's pages may keep pinned;
    # hits beyond it are misses. None: a quarter of the landing tier.
    max_waiting_pin_bytes: Optional[int] = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ConnectorSettings":
        prefix = "ucm_"
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for k, v in (extra or {}).items():
            if not k.startswith(prefix):
                continue
            name = k[len(prefix):] if k != "ucm_config" else "ucm_config"
            if name not in known:
                raise ConfigError(f"kv_connector_extra_config: unknown key {k!r}; allowed: "
                                  f"{sorted(prefix + n if n != 'ucm_config' else n for n in known)}")
            kwargs[name] = v
        s = cls(**kwargs)
        if s.load_mode not in _LOAD_MODES:
            raise ConfigError(f"kv_connector_extra_config.ucm_load_mode: {s.load_mode!r} not one of {list(_LOAD_MODES)}")
        if not (isinstance(s.load_timeout_s, (int, float)) and s.load_timeout_s > 0):
            raise ConfigError(f"kv_connector_extra_config.ucm_load_timeout_s must be > 0, got {s.load_timeout_s!r}")
        cap = s.max_waiting_pin_bytes
        if cap is not None and not (isinstance(cap, int) and not isinstance(cap, bool) and cap > 0):
            raise ConfigError(f"kv_connector_extra_config.ucm_max_waiting_pin_bytes must be a positive int "
                              f"(bytes) or absent, got {cap!r}")
        return s


def model_identity(model_config: Any) -> str:
    """The model part of the block namespace for vLLM's `ModelConfig`: a
    fingerprint of the weights (`identity.model_fingerprint` over the model
    directory or file, vLLM's effective hf_config with its overrides, the
    revision and code revision, the quantization method, the compute dtype
    and, for weights pulled from object storage, their URI). The served
    name and the path are labels, not part of it: changed weights behind
    the same name or path get a new namespace."""
    from ucm.connectors.identity import model_fingerprint

    mc = model_config
    extra = {"engine": "vllm", "dtype": str(mc.dtype).removeprefix("torch."),
             "quantization": mc.quantization, "code_revision": mc.code_revision,
             "model_weights": mc.model_weights or None}
    fp = model_fingerprint(mc.model, revision=mc.revision, config=mc.hf_config.to_dict(), extra=extra)
    return f"weights:{fp.digest}"


def build_namespace(vllm_config: "VllmConfig", block_tokens: int, model_id: Optional[str] = None,
                    kv_layout: Optional[str] = None) -> Namespace:
    """The namespace of this engine's blocks: everything that changes the
    bytes of a page (the model's identity, KV dtype, shape, page size,
    platform and, off CPU, vLLM's physical KV layout: CUDA backends order a
    page's bytes in several ways; the CPU backend has one, LBHNC, and its
    name is kept as it was so existing CPU blocks stay valid). The model's
    identity is `model_id` when given (kv_connector_extra_config's
    `ucm_model_id`), else `model_identity(vllm_config.model_config)`."""
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(cc.cache_dtype)
    if dtype == "auto":
        dtype = str(mc.dtype).removeprefix("torch.")
    if dtype not in _KV_DTYPES:
        raise ConfigError(f"vLLM KV cache dtype {dtype!r} is not supported by ucm; allowed: {sorted(_KV_DTYPES)}")
    return Namespace(
        model=model_id or model_identity(mc),
        kv_dtype=_KV_DTYPES[dtype],
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        block_tokens=block_tokens,
        tp_rank=0,
        tp_size=pc.tensor_parallel_size,
        layout=f"vllm-{current_platform.device_type}-page{cc.block_size}" + (
            f"-{kv_layout}" if kv_layout and current_platform.device_type != "cpu" else ""),
    )


class UCMConnector(KVConnectorBase_V1):
    """ucm behind vLLM's KV connector API; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra(ktc.kv_connector_extra_config or {})
        self.config = load_config(self.settings.ucm_config)
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ConfigError(f"UCMConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 for now, "
                              f"got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(f"UCMConnector supports one KV cache group, got {len(kv_cache_config.kv_cache_groups)}")
        self.page_tokens = vllm_config.cache_config.block_size
        self.block_tokens = self.config.block_tokens
        if self.block_tokens % self.page_tokens:
            raise ConfigError(
                f"block_tokens: {self.block_tokens} is not a multiple of vLLM's page size (--block-size) "
                f"{self.page_tokens}; use a multiple of {self.page_tokens}, e.g. {self.page_tokens} or "
                f"{2 * self.page_tokens}")
        self.pages_per_block = self.block_tokens // self.page_tokens
        self.can_load = ktc.is_kv_consumer
        self.can_save = ktc.is_kv_producer
        self._cache = _open_cache(self.config)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config)
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later miss, nothing more

    # =========================================================================
    # Scheduler side (engine-core process)
    # =========================================================================
    def _init_scheduler(self, vllm_config: "VllmConfig") -> None:
        kv_layout = (getattr(self._kv_cache_config, "kv_cache_layout", None)
                     or getattr(vllm_config.cache_config, "kv_cache_layout", None))
        self.namespace = build_namespace(vllm_config, self.block_tokens, self.settings.model_id, kv_layout)
        self._seed = self.namespace.digest()
        self._landing = self.config.landing_tier
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadJob] = []
        # Blocks whose save is planned but not yet reported done (per request
        # and counted per key): a request arriving meanwhile (the next turn of
        # a chat) still hits them; its load waits in the worker for the save.
        self._saving_keys: dict[str, list[Key]] = {}
        self._saving: Counter = Counter()
        # Pins held by requests that wait for vLLM's pages (nothing bounds
        # how many wait), capped; a running request's pins are bounded by
        # the pages vLLM gave it.
        group = self._kv_cache_config.kv_cache_groups[0]
        block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names) * self.pages_per_block
        cap = self.settings.max_waiting_pin_bytes
        if cap is None:
            cap = next(t.capacity for t in self.config.tiers if t.adapter == self._landing) // 4
        self._max_waiting_pinned = cap // block_bytes  # in blocks
        self._waiting_pinned = 0
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("UCMConnector: kv_load_failure_policy is %r; set it to 'recompute' so that a block "
                        "lost between lookup and load is recomputed instead of failing the request",
                        self._kv_transfer_config.kv_load_failure_policy)
        mc = vllm_config.model_config
        log.info("UCMConnector scheduler: model %s (%s) identified as %s; namespace %s, block_tokens %d "
                 "(%d pages); waiting requests pin at most %d blocks", mc.served_model_name or mc.model,
                 mc.model, "set by ucm_model_id" if self.settings.model_id else "its weights", self.namespace,
                 self.block_tokens, self.pages_per_block, self._max_waiting_pinned)

    def _state(self, request: "Request") -> Optional[_ReqState]:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        if request.prompt_token_ids is None or request.mm_features:
            return None  # prompt embeddings / multimodal: the tokens do not name the bytes
        salt = []
        if request.cache_salt:
            salt.append(f"salt={request.cache_salt}")
        if request.lora_request is not None:
            salt.append(f"lora={request.lora_request.lora_name}")
        seed = dataclasses.replace(self.namespace, salt=";".join(salt)).digest() if salt else self._seed
        st = _ReqState(keys=block_keys(seed, request.prompt_token_ids, self.block_tokens))
        self._reqs[request.request_id] = st
        return st

    def _unpin(self, st: _ReqState) -> None:
        if st.pinned:
            self._cache.unpin(st.pinned)
            if not st.allocated:
                self._waiting_pinned -= len(st.pinned)
            st.pinned = []

    def _lookup(self, st: _ReqState) -> None:
        """Longest cached prefix, pinned so it stays until the request ends.
        A request that is not allocated yet pins at most what is left of
        the waiting-pin cap (all of its hit when no other waiting request
        holds pins, so one long prompt still hits whole); the blocks beyond
        are misses for now."""
        self._unpin(st)
        st.looked_up = True
        # After two lost loads the request is computed without ucm's help.
        n = self._cache.lookup(st.keys) if st.keys and self.can_load and st.load_failures < 2 else 0
        if st.allocated or self._waiting_pinned == 0:
            room = n
        else:
            room = max(0, self._max_waiting_pinned - self._waiting_pinned)
        st.capped = n > room
        n = min(n, room)
        if n:
            self._cache.pin(st.keys[:n])
            m = self._cache.lookup(st.keys[:n])  # still there now that it is pinned?
            if m < n:
                self._cache.unpin(st.keys[m:n])
            n = m
        st.pinned = st.keys[:n]
        if not st.allocated:
            self._waiting_pinned += n
        st.hit_tiers = self._cache.locate(st.keys[:n]) if n else []
        if self._saving and st.load_failures < 2 and not st.capped:
            while n < len(st.keys) and st.keys[n] in self._saving:
                n += 1
            st.hit_tiers = [PENDING if k in self._saving else t
                            for k, t in zip(st.keys, st.hit_tiers + [PENDING] * (n - len(st.hit_tiers)))]
        st.hit_blocks = n
        st.next_store = max(st.next_store, n)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        st = self._state(request)
        if st is None:
            return 0, False
        if not st.looked_up or (st.capped and not st.allocated
                                and self._waiting_pinned < self._max_waiting_pinned):
            self._lookup(st)
        st.local_tokens = num_computed_tokens
        mode = self.settings.load_mode
        blocks = st.hit_blocks
        if mode == "sync":  # a synchronous load never waits for a save: stop at the first one in flight
            blocks = next((i for i, t in enumerate(st.hit_tiers[:blocks]) if t == PENDING), blocks)
        # A full hit is reported one token short: vLLM must compute the last
        # prompt token to sample the next one.
        hit = min(blocks * self.block_tokens, request.num_tokens - 1)
        if hit <= num_computed_tokens:
            return 0, False
        first, last = num_computed_tokens // self.block_tokens, -(-hit // self.block_tokens)
        if mode == "auto":
            is_async = any(t != self._landing for t in st.hit_tiers[first:last])
        else:
            is_async = mode == "async"
        st.load_async = is_async
        return hit - num_computed_tokens, is_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if not st.allocated:  # running now: its pins leave the waiting budget
            st.allocated = True
            self._waiting_pinned -= len(st.pinned)
        st.page_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        start, end = st.local_tokens, st.local_tokens + num_external_tokens
        first_page, end_page = start // self.page_tokens, -(-end // self.page_tokens)
        b0, b1 = start // self.block_tokens, -(-end // self.block_tokens)
        ppb = self.pages_per_block
        pages = []
        for b in range(b0, b1):
            row = []
            for j in range(ppb):
                p = b * ppb + j
                row.append(st.page_ids[p] if first_page <= p < min(end_page, len(st.page_ids)) else SKIP)
            pages.append(row)
        # An async load is reported through get_finished; it must be async
        # exactly when get_num_new_matched_tokens said so.
        self._pending_loads.append(LoadJob(request.request_id, st.keys[b0:b1], pages, st.load_async))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = UCMConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        sched = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(r.req_id)
            if st is None:
                continue
            st.page_ids = list(r.block_ids[0])
            self._plan_store(r.req_id, st, r.num_computed_tokens + sched.get(r.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.page_ids = list(new[0]) if new else []
            elif new:
                st.page_ids.extend(new[0])
            self._plan_store(req_id, st, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta)
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.preempted.add(req_id)
            st = self._reqs.get(req_id)
            if st is not None:  # its pages are gone; look up again when it resumes
                st.page_ids = []
                st.looked_up = False
                # Its saves not yet copied were dropped (handle_preemptions):
                # save again what the next lookup does not find.
                st.next_store = 0
                self._unpin(st)
                st.allocated = False
        return meta

    def _plan_store(self, req_id: str, st: _ReqState, computed_tokens: int, meta: UCMConnectorMetadata) -> None:
        if not self.can_save:
            return
        full = min(computed_tokens // self.block_tokens, len(st.keys), len(st.page_ids) // self.pages_per_block)
        if full <= st.next_store:
            return
        ppb = self.pages_per_block
        b0 = st.next_store
        meta.stores.append(StoreJob(
            req_id=req_id,
            keys=st.keys[b0:full],
            page_ids=[st.page_ids[b * ppb:(b + 1) * ppb] for b in range(b0, full)],
            parent=st.keys[b0 - 1] if b0 else None,
        ))
        st.next_store = full
        st.stores_issued = True
        self._saving_keys.setdefault(req_id, []).extend(st.keys[b0:full])
        self._saving.update(st.keys[b0:full])

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        for req_id in connector_output.finished_sending or ():
            self._saving.subtract(self._saving_keys.pop(req_id, ()))
            self._saving += Counter()  # drop zero counts
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for st in self._reqs.values():
            for p, page in enumerate(st.page_ids):
                if page in bad:
                    # Recomputed blocks are saved again; and the memoised hit
                    # is stale: vLLM asks again (for the recomputed request)
                    # and must get a fresh answer, or a dead service would
                    # be asked to load the same blocks forever.
                    st.next_store = min(st.next_store, p // self.pages_per_block)
                    st.looked_up = False
                    st.load_failures += 1
                    self._unpin(st)
                    break

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._unpin(st)
        out = getattr(request, "num_output_tokens", None)
        if st.keys and isinstance(out, int):
            # A placement hint: how long an answer this prompt got (ucm/reuse.py).
            self._cache.finish(st.keys, out)
        # Saves in flight read these pages: keep them until the worker reports
        # the request in get_finished's finished_sending.
        return st.stores_issued, None

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if num_external_tokens == 0:
            return {}
        st = self._reqs.get(request.request_id)
        if st is None or not st.hit_tiers:
            return {self._cache_hit_source: num_external_tokens}
        below = any(t not in (self._landing, PENDING) for t in st.hit_tiers)
        return {CacheHitSource.DISK if below else CacheHitSource.HOST: num_external_tokens}

    # =========================================================================
    # Worker side (worker process)
    # =========================================================================
    def _init_worker(self) -> None:
        self._layouts: list[PageLayout] = []  # per layer (in layer order): where its pages lie
        self._buffers: list[Any] = []  # per layer: its whole storage as a buffer (CPU path)
        self._copier: Optional[Any] = None  # TorchPageCopier for device tensors
        self._page_bytes = 0
        self._num_pages = 0
        self._copy_threads = max(1, min(4, len(os.sched_getaffinity(0))))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ucm-vllm")
        # req_id -> background jobs touching its pages, each with its hold on them
        self._inflight: dict[str, list[tuple[Future, _PageGuard]]] = {}
        self._saves: dict[Key, Future] = {}  # block key -> the save in flight writing it
        self._pending_saves: dict[str, int] = {}  # req_id -> saves not yet done
        self._saving_reqs: set[str] = set()  # every request that got a save
        self._finished_saving: set[str] = set()  # finished by vLLM, waiting for saves
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._tainted: set[str] = set()  # requests whose synchronous load failed this step
        self.counters = {"loaded_blocks": 0, "load_failed_blocks": 0, "stored_blocks": 0,
                         "store_failed_blocks": 0, "abandoned_blocks": 0, "tainted_blocks": 0,
                         "load_s": 0.0, "store_s": 0.0}

    def _num_kv_blocks(self, first: torch.Tensor) -> tuple[int, dict[str, int]]:
        """vLLM's number of KV blocks (the size of each layer's page
        dimension) and, per layer name, the engine's byte stride between
        blocks when it states one. Without a KVCacheConfig (tests driving
        the worker alone) the first dimension is taken as the page one."""
        kcc = getattr(self, "_kv_cache_config", None)
        num_blocks = getattr(kcc, "num_blocks", None)
        if not num_blocks:
            return first.shape[0], {}
        strides = {name: t.block_stride for t in getattr(kcc, "kv_cache_tensors", ()) or ()
                   for name in getattr(t, "layers", ())}
        return num_blocks, strides

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Finds, per layer, the dimension indexing vLLM's pages and the byte
        chunks of a page (`kv_pages.page_layout`); copies then go between
        those chunks and the arena slots. CPU tensors are copied with native
        memcpys, CUDA tensors with torch ops (`TorchPageCopier`)."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        first = kv_caches[names[0]]
        num_blocks, block_strides = self._num_kv_blocks(first)
        devices = {kv_caches[n].device for n in names}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ConfigError(f"UCMConnector copies KV tensors on one CPU or CUDA device, "
                              f"got {sorted(map(str, devices))}")
        layouts = []
        for name in names:
            t = kv_caches[name]
            itemsize = t.element_size()
            dim = find_page_dim(name, t.shape, num_blocks, [s * itemsize for s in t.stride()],
                                block_strides.get(name))
            layouts.append(page_layout(name, t.shape, t.stride(), itemsize, t.storage_offset(), dim))
        sizes = {lay.page_bytes for lay in layouts}
        if len(sizes) != 1:
            raise ConfigError(f"UCMConnector needs equal page sizes in every layer, got {sorted(sizes)} bytes")
        storages, buffers, seen = [], [], {}
        for name, lay in zip(names, layouts):
            st = kv_caches[name].untyped_storage()
            flat = seen.get(st.data_ptr())
            if flat is None:
                flat = seen[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            if lay.storage_extent() > flat.numel():
                raise ConfigError(f"KV tensor {name}: pages reach byte {lay.storage_extent()} of a "
                                  f"{flat.numel()}-byte storage")
            storages.append(flat)
        self._layouts = layouts
        self._page_bytes = layouts[0].page_bytes
        self._num_pages = min(lay.num_pages for lay in layouts)
        if first.device.type == "cpu":
            arrays = {id(f): f.numpy() for f in storages}  # buffers for the native copies (same memory)
            self._buffers = [arrays[id(f)] for f in storages]
        else:
            from ucm.connectors.torch_pages import TorchPageCopier

            self._copier = TorchPageCopier(storages, layouts, self.pages_per_block)
        log.info("UCMConnector worker: %d layers on %s, %d pages of %d bytes in %d chunk(s) (layer tensor %s %s "
                 "strides %s); block payload %d bytes", len(layouts), first.device, self._num_pages,
                 self._page_bytes, len(layouts[0].chunks), tuple(first.shape), first.dtype, first.stride(),
                 self._block_bytes)

    # ---- page copies ----------------------------------------------------------
    # A block's payload is, for each layer, its pages in order, each page its
    # chunks in memory order. On CPU, copies go straight between the layer
    # storages and the arena slots, one native call per layer and chunk
    # (every page of every block of the chunk), GIL released; device tensors
    # go through TorchPageCopier.
    @property
    def _block_bytes(self) -> int:
        return len(self._layouts) * self.pages_per_block * self._page_bytes

    def _blocks(self, page_ids: list[list[int]], first: int, slots: list) -> list[tuple[int, list[int]]]:
        """(payload offset in the arena, page ids) of the blocks that have a slot."""
        out = []
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            pages = page_ids[first + i]
            for p in pages:
                if p != SKIP and not 0 <= p < self._num_pages:
                    raise IndexError(f"vLLM page id {p} outside the KV cache (0..{self._num_pages - 1})")
            out.append((slot[0], pages))
        return out

    def _copy_layers(self, to_arena: bool, page_ids: list[list[int]], first: int, slots: list, arena: Any,
                     threads: int, ready: Any = None) -> None:
        blocks = self._blocks(page_ids, first, slots)
        if self._copier is not None:
            self._copier.copy(to_arena, blocks, arena, ready)
            return
        from ucm import _native

        pb = self._page_bytes
        pages = [(a + j * pb, p) for a, ids in blocks for j, p in enumerate(ids) if p != SKIP]
        if not pages:
            return
        step = self.pages_per_block * pb
        for layer, (buf, lay) in enumerate(zip(self._buffers, self._layouts)):
            for (off, n), pos in zip(lay.chunks, lay.payload_offsets):
                at = [a + layer * step + pos for a, _ in pages]
                kv = [lay.base + p * lay.page_stride + off for _, p in pages]
                if to_arena:
                    _native.copy_spans(arena, at, buf, kv, n, threads)
                else:
                    _native.copy_spans(buf, kv, arena, at, n, threads)

    # ---- loads ---------------------------------------------------------------
    def _load(self, job: LoadJob, ready: Any = None, guard: Optional[_PageGuard] = None) -> bool:
        """Copies the job's blocks into its pages; pages of blocks that did not
        arrive (and of every block after the first such) become load errors.
        `ready`: on CUDA, an event the copies wait for (the work queued on the
        engine's stream before the load was submitted). A synchronous load
        runs in the forward and never waits for a save in flight (a block
        still being saved is a load error: vLLM recomputes it); an
        asynchronous one waits for those saves, at most load_timeout_s.
        `guard`: an asynchronous load's hold on the pages; once revoked it
        copies and reports nothing (the pages are other requests' now).
        Returns whether every block arrived."""
        started = time.perf_counter()
        guard = guard if guard is not None else _PageGuard()
        n = len(job.keys)
        ok = 0
        # Synchronous loads hold up the forward, whose threads are idle meanwhile.
        threads = 1 if job.is_async else self._copy_threads

        def fill(first: int, slots: list, arena: Any) -> None:
            with guard.pages():
                self._copy_layers(False, job.page_ids, first, slots, arena, threads, ready)

        try:
            from ucm.cache import Outcome

            if job.is_async:
                self._wait_saves(job.keys)
            if not guard.revoked:
                results = self._cache.read_slots(job.keys, [self._block_bytes] * n, fill)
                while ok < n and results[ok] is Outcome.DONE:
                    ok += 1
        except Exception:  # a cache fault is a miss for vLLM, never an exception
            log.exception("UCMConnector: load for %s failed", job.req_id)
            ok = 0
        bad = {p for pages in job.page_ids[ok:] for p in pages if p != SKIP}
        try:
            with guard.pages():  # errors are reported only for pages the request still has
                with self._lock:
                    self._load_errors |= bad
                    self.counters["loaded_blocks"] += ok
                    self.counters["load_failed_blocks"] += n - ok
                    self.counters["load_s"] += time.perf_counter() - started
        except _PagesRevoked:
            with self._lock:
                self.counters["abandoned_blocks"] += n
            log.info("UCMConnector: load for %s abandoned: the request was preempted", job.req_id)
            return False
        if bad:
            log.warning("UCMConnector: %d of %d blocks of %s did not load; vLLM recomputes them", n - ok, n,
                        job.req_id)
        return not bad

    def _load_async(self, job: LoadJob, ready: Any, guard: _PageGuard) -> None:
        try:
            self._load(job, ready, guard)
        finally:
            with self._lock:
                self._done_recving.add(job.req_id)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._tainted = set()  # a step's mark, never the next step's
        meta = self._connector_metadata
        if not isinstance(meta, UCMConnectorMetadata) or not meta.loads or not self._layouts:
            return
        # Pages given to these requests may still be in use by kernels queued
        # earlier (a request that just finished): on CUDA, loads wait for them.
        ready = self._copier.record_ready() if self._copier is not None else None
        for job in meta.loads:
            if job.is_async:
                guard = _PageGuard()
                self._track(job.req_id, self._pool.submit(self._load_async, job, ready, guard), guard)
            elif not self._load(job, ready):
                # This step's forward runs over the pages that did not arrive:
                # whatever it computes for the request is not saved.
                self._tainted.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv

    # ---- saves ---------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        """Submits this step's saves (the forward has written the pages); they
        run in the background and hold the request's pages until reported."""
        meta = self._connector_metadata
        if not isinstance(meta, UCMConnectorMetadata) or not meta.stores or not self._layouts:
            return
        # On CUDA the forward may still be running: saves wait for this event.
        ready = self._copier.record_ready() if self._copier is not None else None
        tainted, self._tainted = self._tainted, set()
        for job in meta.stores:
            if job.req_id in tainted:  # computed over pages a failed load left: never stored
                with self._lock:
                    self._saving_reqs.add(job.req_id)  # still reported in finished_sending
                    self.counters["tainted_blocks"] += len(job.keys)
                log.warning("UCMConnector: %d blocks of %s not saved: this step computed them over pages "
                            "that did not load", len(job.keys), job.req_id)
                continue
            guard = _PageGuard()
            with self._lock:
                self._pending_saves[job.req_id] = self._pending_saves.get(job.req_id, 0) + 1
                self._saving_reqs.add(job.req_id)
                fut = self._pool.submit(self._save, job, ready, guard)
                for k in job.keys:
                    self._saves[k] = fut
            fut.add_done_callback(lambda f, keys=job.keys: self._saved(keys, f))
            self._track(job.req_id, fut, guard)

    def _saved(self, keys: list[Key], fut: Future) -> None:
        with self._lock:
            for k in keys:
                if self._saves.get(k) is fut:
                    del self._saves[k]

    def _wait_saves(self, keys: list[Key]) -> None:
        """Waits for the saves in flight of `keys` (an asynchronous load
        planned while they were being saved), at most load_timeout_s in all;
        runs on the background pool, never in the forward. Saves were
        submitted before this load and wait on nothing, so they finish even
        on a busy pool."""
        with self._lock:
            futs = {id(f): f for f in (self._saves.get(k) for k in keys) if f is not None}
        deadline = time.monotonic() + self.settings.load_timeout_s
        for f in futs.values():
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # a failed or slow save shows up as a missing block
                pass

    def _save(self, job: StoreJob, ready: Any = None, guard: Optional[_PageGuard] = None) -> None:
        """Copies the job's pages into reserved slots, then the client commits
        them. `guard`: the save's hold on the pages; a chunk whose copy finds
        it revoked is aborted (never committed with bytes of pages that may
        have been reused), and so are the chunks after it."""
        started = time.perf_counter()
        guard = guard if guard is not None else _PageGuard()
        stored = 0

        def fill(first: int, slots: list, arena: Any) -> None:
            with guard.pages():
                self._copy_layers(True, job.page_ids, first, slots, arena, 1, ready)

        try:
            from ucm.cache import Outcome

            if not guard.revoked:
                results = self._cache.write_slots(job.keys, [self._block_bytes] * len(job.keys), fill,
                                                  parent=job.parent)
                stored = sum(r is Outcome.DONE for r in results)
        except Exception:
            log.exception("UCMConnector: save for %s failed", job.req_id)
        finally:
            abandoned = len(job.keys) - stored if guard.revoked else 0
            with self._lock:
                self._pending_saves[job.req_id] -= 1
                self.counters["stored_blocks"] += stored
                self.counters["store_failed_blocks"] += len(job.keys) - stored - abandoned
                self.counters["abandoned_blocks"] += abandoned
                self.counters["store_s"] += time.perf_counter() - started
            if abandoned:
                log.info("UCMConnector: %d block(s) of %s not saved: the request was preempted before they "
                         "were copied", abandoned, job.req_id)

    def _track(self, req_id: str, fut: Future, guard: _PageGuard) -> None:
        with self._lock:
            jobs = [(f, g) for f, g in self._inflight.get(req_id, ()) if not f.done()]
            jobs.append((fut, guard))
            self._inflight[req_id] = jobs

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Preempted requests' pages are about to be reused (vLLM calls this
        before the step that may hand them to other requests). Takes the
        pages back from their background jobs without waiting for their
        I/O: only a copy in progress is waited for (one memcpy of at most a
        client chunk). A save that had copied its pages commits them; one
        that had not is dropped (a later miss); a load writes no page and
        reports no error from then on."""
        if not isinstance(kv_connector_metadata, UCMConnectorMetadata):
            return
        for req_id in kv_connector_metadata.preempted:
            with self._lock:
                jobs = self._inflight.pop(req_id, [])
            for _, guard in jobs:
                guard.revoke()

    # ---- completion ------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        with self._lock:
            for r in finished_req_ids:  # forget finished load-only requests' (done) jobs
                if r not in self._saving_reqs and all(f.done() for f, _ in self._inflight.get(r, ())):
                    self._inflight.pop(r, None)
            self._finished_saving.update(r for r in finished_req_ids if r in self._saving_reqs)
            done_sending = {r for r in self._finished_saving if self._pending_saves.get(r, 0) == 0}
            for r in done_sending:
                self._finished_saving.discard(r)
                self._saving_reqs.discard(r)
                self._pending_saves.pop(r, None)
                self._inflight.pop(r, None)
            done_recving, self._done_recving = self._done_recving, set()
        return done_sending or None, done_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)  # saves in flight finish before the engine goes
            log.info("UCMConnector worker: %s", self.counters)
        copier = getattr(self, "_copier", None)
        if copier is not None:
            copier.close()  # unregisters the pinned arena(s)
            self._copier = None
        cache = getattr(self, "_cache", None)
        if cache is not None:
            try:
                cache.close()
            except Exception:
                log.debug("closing the cache client failed", exc_info=True)
