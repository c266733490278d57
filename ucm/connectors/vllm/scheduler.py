"""UCMSchedulerSide: the scheduler half of UCMConnector, in vLLM's
engine-core process, on the scheduler's thread.

Per request it keys the prompt's full blocks (`ucm.keys.block_keys` under
the engine's namespace, salted by `cache_salt` and the LoRA adapter), asks
the cache how long a prefix it holds, pins that prefix so the hit it
reports stays deliverable, and plans per step which blocks the workers load
and save (`metadata.UCMConnectorMetadata`). It makes short control calls to
the cache only (lookup, locate, pin, unpin, begin_request, finish), never
payload copies; any exception from the cache is logged and answered as a
miss, never raised into vLLM.

The state machine of one request (`request_state.ReqState`):
- `on_new_request` (vLLM added it; it may queue): keys and
  `cache.begin_request` (the access the placement policy counts, once);
  with a prefetch policy, lookup, pins and the staging of its hit below
  the landing tier start here, while it waits;
- first `get_num_new_matched_tokens`: the same if not done yet; the answer is
  memoised (vLLM asks repeatedly and expects no side effects). A request
  still waiting for vLLM's pages pins at most what is left of the
  waiting-pin cap (the only waiting request pins its whole hit). The cap
  is charged only for pins that hold landing-tier room: blocks found there
  that the request's own staging did not bring (those are bounded by the
  staging budget); a pinned block below the landing tier holds none (a
  pinned block may leave a tier that another also holds). A capped
  request looks up again when there is room; under `wait_complete` or
  `timeout` it waits for that room (bounded, `PrefetchPolicy.wait_for_room`).
- `update_state_after_alloc`: it runs; its pins leave the waiting budget;
  the load of the blocks beyond vLLM's own hit is planned.
- `build_connector_meta`: saves of the blocks its computed tokens filled;
  a preemption releases its pins and resets it (a fresh lookup on resume,
  the blocks whose saves were dropped are planned again).
- `update_connector_output`: pages that failed to load reset the request
  (recomputed blocks are saved again; after two lost loads ucm stays out of
  it); finished saves stop counting as pending hits.
- `request_finished`: pins released, `cache.finish` with the output length
  and the request id; the pages are kept while its saves run.

Blend (blend_request.py): a request that declares `ucm_chunks` claims its
blended part as a synchronous load, filled by the worker (blend.py); none
of its blocks is saved; a failed blend makes it a plain request.

P/D (pd.py): a request that asks this engine to prefill for a decode
engine (`do_remote_decode`) gets the keys of the blocks it saved back in
its finished output's `kv_transfer_params`; a request whose params name a
prefill engine's blocks (`do_remote_prefill`) claims them as an
asynchronous load whose worker waits for them (`ucm_pd_wait_s`), even
those not committed yet; a load that lost some ends the claim, and the
request is looked up like any other.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ucm.api import CacheAPI, Handle, Key
from ucm.connectors.kv_pages import SKIP
from ucm.connectors.vllm.blend_request import BlendPlanner
from ucm.connectors.vllm.kv_events import EngineEvents, events_for, request_extra, request_seed
from ucm.connectors.vllm.load_choice import PENDING, choose_load
from ucm.connectors.vllm.metadata import BlendJob, LoadJob, StoreJob, UCMConnectorMetadata
from ucm.connectors.vllm.namespace import build_namespace
from ucm.connectors.vllm import pd
from ucm.connectors.vllm.prefetch_policy import PrefetchPolicy, StagingStep
from ucm.connectors.vllm.request_state import MAX_LOAD_FAILURES, ReqState as _ReqState
from ucm.connectors.vllm.settings import ConnectorSettings, pages_per_block
from ucm.errors import ConfigError
from ucm.keys import Namespace, block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ucm.config.schema import UcmConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


class UCMSchedulerSide:
    """The scheduler's request state machine; see the module docstring.
    Not thread-safe: vLLM calls it from its scheduler thread only."""

    def __init__(self, cache: CacheAPI, namespace: Namespace, *, page_tokens: int, landing_tier: str,
                 max_waiting_pin_blocks: int, settings: ConnectorSettings = ConnectorSettings(),
                 can_load: bool = True, can_save: bool = True, max_staging_blocks: Optional[int] = None,
                 below_tiers: Optional[frozenset] = None) -> None:
        """`namespace.block_tokens` tokens per ucm block, a multiple of
        vLLM's `page_tokens`; `landing_tier`: the tier whose hits load
        synchronously in "auto" mode; `max_waiting_pin_blocks`: the
        landing-tier blocks that requests waiting for vLLM's pages may keep
        pinned in all; `below_tiers`: the tiers below the landing one (None:
        every other tier), whose pins the cap does not count."""
        if not isinstance(max_waiting_pin_blocks, int) or max_waiting_pin_blocks < 0:
            raise ConfigError(f"max_waiting_pin_blocks must be an int >= 0, got {max_waiting_pin_blocks!r}")
        self._cache = cache
        self.namespace = namespace
        self.settings = settings
        self.block_tokens = namespace.block_tokens
        self.page_tokens = page_tokens
        self.pages_per_block = pages_per_block(self.block_tokens, page_tokens)
        self.can_load, self.can_save = can_load, can_save
        self._seed = namespace.digest()
        self._landing = landing_tier
        self._below = below_tiers
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[LoadJob] = []
        self._pending_blends: list[BlendJob] = []
        self.blends = BlendPlanner(namespace)  # blended requests (blend_request.py); from_vllm sets the engine's
        # Blocks whose save is planned but not yet reported done (per request
        # and counted per key): a request arriving meanwhile (the next turn of
        # a chat) still hits them; its load waits in the worker for the save.
        self._saving_keys: dict[str, list[Key]] = {}
        self._saving: Counter = Counter()
        # Pins held by requests that wait for vLLM's pages (nothing bounds
        # how many wait), capped; a running request's pins are bounded by
        # the pages vLLM gave it.
        self.max_waiting_pin_blocks = max_waiting_pin_blocks
        self.waiting_pinned_blocks = 0
        # The prefetch policy: stagings of hits below the landing tier, their
        # budget (None: unbounded) and queue, and its figures (`staging_stats`).
        self.stagings = PrefetchPolicy(self._prefetch, landing_tier=landing_tier, block_tokens=self.block_tokens,
                                       max_staging_blocks=max_staging_blocks)
        self.bad_request_settings = 0  # requests whose kv_transfer_params overrides were refused
        self.pd_requests = 0  # decode steps of P/D that claimed a prefill engine's blocks
        # The cache's blocks as KV events (kv_events.py), when vLLM publishes them.
        self.events: Optional[EngineEvents] = None

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", config: "UcmConfig",
                  settings: ConnectorSettings, cache: CacheAPI) -> "UCMSchedulerSide":
        """The scheduler side for this engine: its namespace, page size and
        the waiting-pin cap in blocks (`settings.max_waiting_pin_bytes`, by
        default a quarter of the landing tier)."""
        ktc = vllm_config.kv_transfer_config
        kv_layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                     or getattr(vllm_config.cache_config, "kv_cache_layout", None))
        namespace = build_namespace(vllm_config, config.block_tokens, settings.model_id, kv_layout)
        page_tokens = vllm_config.cache_config.block_size
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = (group.kv_cache_spec.page_size_bytes * len(group.layer_names)
                       * pages_per_block(config.block_tokens, page_tokens))
        cap = settings.max_waiting_pin_bytes
        if cap is None:
            cap = next(t.capacity for t in config.tiers if t.adapter == config.landing_tier) // 4
        landing_bytes = next(t.capacity for t in config.tiers if t.adapter == config.landing_tier)
        names = [t.adapter for t in config.tiers]
        side = cls(cache, namespace, page_tokens=page_tokens, landing_tier=config.landing_tier,
                   max_waiting_pin_blocks=cap // block_bytes, settings=settings,
                   can_load=ktc.is_kv_consumer, can_save=ktc.is_kv_producer,
                   max_staging_blocks=max(1, landing_bytes // 2 // block_bytes),  # half of it: the staging budget
                   below_tiers=frozenset(names[names.index(config.landing_tier) + 1:]))
        side.events = events_for(vllm_config, cache, namespace)
        side.blends = BlendPlanner.from_vllm(vllm_config, namespace, settings.blend_separator)
        if ktc.kv_load_failure_policy != "recompute":
            log.warning("UCMConnector: kv_load_failure_policy is %r; set it to 'recompute' so that a block "
                        "lost between lookup and load is recomputed instead of failing the request",
                        ktc.kv_load_failure_policy)
        mc = vllm_config.model_config
        log.info("UCMConnector scheduler: model %s (%s) identified as %s; namespace %s, block_tokens %d "
                 "(%d pages); waiting requests pin at most %d blocks", mc.served_model_name or mc.model,
                 mc.model, "set by ucm_model_id" if settings.model_id else "its weights", namespace,
                 side.block_tokens, side.pages_per_block, side.max_waiting_pin_blocks)
        return side

    # ---- the cache, where a fault is a miss ------------------------------------
    def _ask(self, what: str, default: T, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the cache; an exception is logged and
        answered `default`: vLLM gets a miss, never the exception."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            log.warning("UCMConnector: cache %s failed; answered as a miss", what, exc_info=True)
            return default

    def _prefetch(self, keys: list[Key]) -> Optional[Handle]:
        """The staging of `keys` into the landing tier (PrefetchPolicy's
        `prefetch`); None when the cache failed."""
        return self._ask("prefetch", None, self._cache.prefetch, keys)

    # ---- requests ----------------------------------------------------------------
    def request_keys(self, request: "Request") -> Optional[list[Key]]:
        """The keys of the prompt's full blocks (a partial last block has
        none), or None for a request whose tokens do not name its KV
        (prompt embeddings, multimodal inputs)."""
        if request.prompt_token_ids is None or request.mm_features:
            return None
        lora = request.lora_request
        seed = (request_seed(self.namespace, request.cache_salt, lora.lora_name if lora is not None else None)
                if request.cache_salt or lora is not None else self._seed)
        return block_keys(seed, request.prompt_token_ids, self.block_tokens)

    def request_settings(self, request: "Request") -> ConnectorSettings:
        """The engine's settings with the request's `ucm_` overrides from its
        `kv_transfer_params` (settings.PER_REQUEST). A bad override is
        logged with the key and the allowed values, and the request runs on
        the engine's settings: never an exception into vLLM."""
        params = getattr(request, "kv_transfer_params", None)
        try:
            return self.settings.for_request(params)
        except ConfigError as e:
            self.bad_request_settings += 1
            log.warning("UCMConnector: request %s: %s; it runs on the engine's settings", request.request_id, e)
            return self.settings

    def _begin(self, request: "Request") -> Optional[_ReqState]:
        """The request's state; made (and the request begun in the cache)
        the first time vLLM asks about it."""
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        keys = self.request_keys(request)
        if keys is None:
            return None
        st = self._reqs[request.request_id] = _ReqState(keys=keys, settings=self.request_settings(request))
        if self.events is not None:
            st.tokens, st.extra = request.prompt_token_ids, request_extra(request)
        pd.begin(st, getattr(request, "kv_transfer_params", None), request.request_id, self.can_load, self.can_save)
        if self.can_load:
            self.blends.begin(st, request)
        self.pd_requests += st.pd_named > 0
        if keys:
            self._ask("begin_request", None, self._cache.begin_request, request.request_id, keys)
        return st

    def _unpin(self, st: _ReqState) -> None:
        if st.pinned:
            self._ask("unpin", None, self._cache.unpin, st.pinned)
            st.pinned = []
        self.waiting_pinned_blocks -= st.pin_charge
        st.pin_charge = 0

    def _charged(self, st: _ReqState, key: Key, tier: Optional[str]) -> bool:
        """Whether a waiting request's pin of `key`, found in `tier`, holds
        landing-tier room (what the waiting-pin cap bounds): not for a block
        below it, nor for one the request's own staging brought up (the
        staging budget bounds those); an unknown tier counts."""
        if tier == self._landing:
            return key not in st.staged
        if tier is None or tier == PENDING:
            return True
        return self._below is not None and tier not in self._below

    def _pin(self, keys: list[Key]) -> int:
        """Pins `keys` and returns how many leading ones are still cached now
        that they are pinned (the others are unpinned again)."""
        try:
            self._cache.pin(keys)
        except Exception:
            log.warning("UCMConnector: cache pin failed; answered as a miss", exc_info=True)
            return 0
        m = min(max(0, self._ask("lookup", 0, self._cache.lookup, keys)), len(keys))
        if m < len(keys):
            self._ask("unpin", None, self._cache.unpin, keys[m:])
        return m

    def _lookup(self, st: _ReqState) -> None:
        """Longest cached prefix, pinned so it stays until the request ends.
        A request that is not allocated yet pins at most what is left of
        the waiting-pin cap (all of its hit when no other waiting request
        holds pins, so one long prompt still hits whole); the blocks beyond
        are misses for now."""
        self._unpin(st)
        st.looked_up = True
        n = 0
        if st.keys and self.can_load and st.load_failures < MAX_LOAD_FAILURES:
            n = min(max(0, self._ask("lookup", 0, self._cache.lookup, st.keys)), len(st.keys))
        charged: list[bool] = []
        if n and not st.allocated:
            tiers = list(self._ask("locate", [None] * n, self._cache.locate, st.keys[:n]))[:n]
            charged = [self._charged(st, k, t) for k, t in zip(st.keys, tiers + [None] * (n - len(tiers)))]
        cut = n
        if not st.allocated and self.waiting_pinned_blocks:
            room, used = max(0, self.max_waiting_pin_blocks - self.waiting_pinned_blocks), 0
            for i, c in enumerate(charged):
                used += c
                if used > room:
                    cut = i
                    break
        st.capped = cut < n
        n = self._pin(st.keys[:cut]) if cut else 0
        st.pinned = st.keys[:n]
        st.pin_charge = sum(charged[:n])
        self.waiting_pinned_blocks += st.pin_charge
        st.hit_tiers = self._ask("locate", [None] * n, self._cache.locate, st.keys[:n]) if n else []
        if self._saving and st.load_failures < MAX_LOAD_FAILURES and not st.capped:
            while n < len(st.keys) and st.keys[n] in self._saving:
                n += 1
            st.hit_tiers = [PENDING if k in self._saving else t
                            for k, t in zip(st.keys, st.hit_tiers + [PENDING] * (n - len(st.hit_tiers)))]
        st.hit_blocks = n
        st.next_store = max(st.next_store, n)

    def _stage(self, st: _ReqState, first: int, arrival: bool = False) -> bool:
        """The prefetch policy's step for the request (`PrefetchPolicy.stage`
        after vLLM's own `first` blocks); True while it waits for its
        staging. A staging that ended is settled against a fresh lookup."""
        step = self.stagings.stage(st, first, arrival=arrival)
        if step in (StagingStep.ARRIVED, StagingStep.LATE):
            self._lookup(st)  # where the blocks are now
            if self.stagings.settle(st, first, step):
                self._lookup(st)  # it gave up: a miss from now on
            return False
        return step is StagingStep.WAIT

    def on_new_request(self, request: "Request") -> None:
        """vLLM added the request; it may wait in the queue for long. It is
        begun in the cache now (a prefetch accelerator there stages on first
        sight), and with a prefetch policy on, its hit below the landing tier
        is looked up, pinned and staged while it waits."""
        try:
            st = self._begin(request)
            if st is None or not st.keys or st.settings.prefetch_policy == "off" or not self.can_load:
                return
            self._lookup(st)
            if st.hit_blocks:
                self._stage(st, 0, arrival=True)
        except Exception:  # never into vLLM: the request is then looked up as usual
            log.warning("UCMConnector: staging a new request failed", exc_info=True)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens ucm can load beyond vLLM's own `num_computed_tokens`, and
        whether the load is asynchronous. Whole blocks only, and never the
        whole prompt: vLLM computes at least its last token."""
        st = self._begin(request)
        if st is None:
            return 0, False
        if st.chunks:  # a blended request: its blended part is the worker's to fill (blend.py)
            claimed = self.blends.claim(st, request, num_computed_tokens)
            if claimed:
                return claimed, False
        if not st.looked_up or (st.capped and not st.allocated
                                and self.waiting_pinned_blocks < self.max_waiting_pin_blocks):
            self._lookup(st)
        if self.stagings.wait_for_room(st):
            return None, False  # capped: vLLM asks again; the lookup is redone once there is room
        st.local_tokens = num_computed_tokens
        if st.pd_named > st.hit_blocks:  # a prefill engine's blocks: loaded asynchronously once committed
            claimed = pd.claim(st, request.num_tokens, num_computed_tokens, self.block_tokens)
            return claimed, claimed > 0
        mode = st.settings.load_mode
        blocks = st.hit_blocks
        if st.settings.prefetch_policy != "off" and blocks and not st.unstaged:
            if self._stage(st, num_computed_tokens // self.block_tokens):
                return None, False  # vLLM asks again next step; the request holds no pages meanwhile
            blocks = st.hit_blocks
            first = num_computed_tokens // self.block_tokens  # vLLM holds the blocks before it
            # Loads only from the landing tier (unless over the staging budget);
            # the blocks from the first one still below are computed.
            blocks = blocks if st.unstaged else next(
                (i for i in range(first, blocks) if st.hit_tiers[i] not in (self._landing, PENDING)), blocks)
        if mode == "sync":  # a synchronous load never waits for a save: stop at the first one in flight
            blocks = next((i for i, t in enumerate(st.hit_tiers[:blocks]) if t == PENDING), blocks)
        hit = min(blocks * self.block_tokens, request.num_tokens - 1)
        if hit <= num_computed_tokens:
            st.external_tokens = 0
            return 0, False
        first, last = num_computed_tokens // self.block_tokens, -(-hit // self.block_tokens)
        is_async, st.load_stream = choose_load(st.hit_tiers[first:last], self._landing, mode,
                                               st.settings.load_streaming)
        st.load_async = is_async
        st.external_tokens = hit - num_computed_tokens
        return st.external_tokens, is_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """vLLM gave the request pages: plan the load of the
        `num_external_tokens` after its own hit, page by page (pages vLLM
        already holds are SKIP)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if not st.allocated:  # running now: its pins leave the waiting budget, its staging the staging one
            st.allocated = True
            self.waiting_pinned_blocks -= st.pin_charge
            st.pin_charge = 0
            self.stagings.leave(st)
        st.page_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens <= 0:
            return
        if st.blending:
            self._pending_blends.append(self.blends.job(st, request))
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
        wait = st.settings.pd_wait_s if st.pd_named and st.load_async else 0.0
        self._pending_loads.append(LoadJob(request.request_id, st.keys[b0:b1], pages, st.load_async,
                                           st.load_stream and not st.load_async, wait))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> UCMConnectorMetadata:
        """This step's plan: the loads planned since the last step, the saves
        of blocks the scheduled tokens fill, and the preempted requests."""
        meta = UCMConnectorMetadata(loads=self._pending_loads, blends=self._pending_blends)
        self._pending_loads, self._pending_blends = [], []
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
                st.staging, st.staging_tried, st.unstaged, st.staged = None, False, False, frozenset()
                st.room_since = 0.0
                self.stagings.leave(st)
                # Its saves not yet copied were dropped (handle_preemptions):
                # save again what the next lookup does not find.
                st.next_store = 0
                self._unpin(st)
                st.allocated = False
        return meta

    def _plan_store(self, req_id: str, st: _ReqState, computed_tokens: int, meta: UCMConnectorMetadata) -> None:
        if not self.can_save or st.blending:  # a blended request's pages are not what its keys name
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
        if self.events is not None:  # what the KV events tell of these blocks once they are held
            self.events.describe(st.keys, st.tokens, st.extra, b0, full)
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
                    st.staging, st.staging_tried = None, False
                    st.load_failures += 1
                    st.pd_named = 0  # what the prefill engine named did not all come: computed here
                    self.blends.failed(st)  # not blended: computed here as a plain request
                    st.external_tokens = 0
                    self._unpin(st)
                    break

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Releases the request's pins and tells the cache it finished;
        True while saves in flight still read its pages (vLLM keeps them
        until the worker reports the request in finished_sending)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._unpin(st)
        self.stagings.leave(st)
        if st.keys:
            # A placement hint: how long an answer this prompt got (ucm/placement/policies/reuse.py).
            self._ask("finish", None, self._cache.finish, st.keys, request.num_output_tokens,
                      request_id=request.request_id)
        return st.stores_issued, pd.finish(st, request, self.block_tokens)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if num_external_tokens == 0:
            return {}
        st = self._reqs.get(request.request_id)
        if st is None or not st.hit_tiers:
            return {CacheHitSource.HOST: num_external_tokens}
        below = any(t not in (self._landing, PENDING) for t in st.hit_tiers)
        return {CacheHitSource.DISK if below else CacheHitSource.HOST: num_external_tokens}

    def take_events(self) -> list:
        """The cache's block changes since the last call as vLLM KV events
        (none unless vLLM publishes events); never raises into vLLM."""
        return self.events.take() if self.events is not None else []

    def staging_stats(self) -> dict[str, float]:
        """The prefetch policy's figures (a snapshot): stagings and blocks
        issued, stagings that came back short or late, requests given up,
        and `wait_s`, the seconds requests waited for staging in all."""
        return self.stagings.stats()

    def shutdown(self) -> None:
        """Releases the pins of every request still known (an engine that
        stops with requests in flight)."""
        if self.stagings.counts["stagings"]:
            log.info("UCMConnector: stagings (engine prefetch policy %s; requests may set their own): %s",
                     self.settings.prefetch_policy, self.staging_stats())
        for st in self._reqs.values():
            self._unpin(st)
        self._reqs.clear()
        if self.events is not None:
            self.events.close()
