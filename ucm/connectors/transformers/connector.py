"""TransformersConnector and UCMCache: `model.generate()` whose prompt prefix
comes from ucm.

    connector = TransformersConnector(model, ucm.connect())     # or a UnifiedCache
    out = connector.generate(input_ids, max_new_tokens=64)       # the cached prefix is not recomputed

or, for a forward loop or a generate call of one's own,

    cache = connector.cache_for(input_ids, attention_mask)       # a transformers DynamicCache
    model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, ...)
    cache.finish()

`cache_for` runs before prefill, in the caller's thread: it keys the full
blocks of every row's prompt (`ucm.keys.block_keys` over the row's real
tokens, after its left padding), counts the request once per row
(`begin_request`), finds the longest cached prefix and has it read into
layer buffers (restore.Restorer) that the request's UCMCache adopts
(request_cache.py; the layers are layers.SpareLayer, which grow in place);
`generate` then sees a non-empty cache and computes only the rest
(it slices the input ids by `get_seq_length()`, as with any cache). After
the forward that completes a prompt block (the prefill, or a chunk of it),
the new full blocks are gathered and stored on one background thread; the
first token never waits for a store (`wait_stores` does, for tests and
benchmarks). `connector.generate` starts that store only once the forward
is over (when the next forward begins, or generate returns), so its gather
and copies do not share the CPU with the forward that makes the token. `finish` tells the cache how many tokens were generated.

Batches. A DynamicCache has one length for every row, and row `b` of a
left-padded batch begins its real tokens after `pad_b` positions, so the
restored length is the common one: `min(pad_b + cached_tokens_b)` (and at
most the prompt length - 1, so the last position is computed and gives the
first token). Each row gets its padding as zeros (masked) and the first
`length - pad_b` tokens of its cached blocks, the last block possibly in
part: the first tokens of a block are exactly what a cropped cache holds.
A row that is not left-padded restores and stores nothing (and the batch
restores nothing). The attention mask given to `cache_for` must be the one
given to `generate` (`connector.generate` passes it).

Faults. Any exception from the cache (lookup, load, store, finish), a load
that misses or times out, or a copy that fails is logged and becomes a
shorter hit or a miss: the model recomputes; nothing raises into
`generate` for a cache fault. `connector.generate` copies a streamed
prefix layer by layer inside the prefill (restore.DeferredLayers); a block
that fails there, after the prefill began, makes it generate again without
the prefix (RestoreFault never leaves `connector.generate`). Misuse (a cache given to generate with other
input ids, a batch whose size changed) is logged and stops that request's
stores, so wrong KV is never stored.

Every call into a cache goes through the connector's guard.CallGuard,
which also holds the counters (`stats`).

Accelerators. The connector builds the engine-side accelerators
(`runs_in = "engine"`, ucm/accelerators/base.py) of the config of the cache
it is given (`cache.config`; the defaults for a cache without one) and
reaches them by type. With the `sparse` entry

    accelerators:
      - name: sparse
        options: {selector: hybrid, budget: {tokens: 1024}}

`generate` decodes sparsely (sparse.py: a SparseDecoder of that
accelerator); `cache_for` is not affected. With the `blend` entry, its
options are how `generate(..., chunks=...)` recomputes reused passages
(blend.py; the defaults without it). Their figures are in
`stats()["accelerators"]`.

Threads: `cache_for`, `generate` and the model's forward run in the
caller's thread; stores and finishes run in that order on the connector's
one store thread. `_lock` guards the in-flight store and job lists.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ucm.accelerators.chain import Accelerators
from ucm.accelerators.sparse import SparseAccelerator
from ucm.api import CacheAPI, Handle, Outcome
from ucm.config.schema import UcmConfig
from ucm.connectors.transformers import front as fronts
from ucm.connectors.transformers.blend import ChunkBlender
from ucm.connectors.transformers.guard import CallGuard
from ucm.connectors.transformers.kv_copy import gather_blocks
from ucm.connectors.transformers.namespace import build_namespace
from ucm.connectors.transformers.prompt_rows import PromptRow
from ucm.connectors.transformers.request_cache import UCMCache
from ucm.connectors.transformers.restore import Restorer, RestoreFault
from ucm.connectors.transformers.sparse import SparseDecoder
from ucm.errors import ArgumentError, ConfigError
from ucm.keys import block_keys

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 256
_ids = itertools.count()


class TransformersConnector:
    """Restores cached prompt prefixes into transformers caches and stores
    new blocks; see the module docstring."""

    def __init__(self, model: Any, cache: CacheAPI, *, block_tokens: Optional[int] = None,
                 model_id: Optional[str] = None, salt: str = "", hbm_bytes: Optional[int] = None,
                 timeout_s: float = 30.0) -> None:
        """`model`: a transformers causal LM (every layer full attention).
        `cache`: any CacheAPI (UnifiedCache, or `ucm.connect(...)`).
        `block_tokens`: tokens per block (default the cache's config, else
        256). `model_id`: the model part of the namespace (default a
        fingerprint of the weights). `salt`: kept apart from other tenants.
        `hbm_bytes`: the process-local hbm front (front.py); None: 1 GiB on
        an accelerator and none on the CPU, or none when `cache` has an hbm
        tier itself; 0: none. `timeout_s`: the longest a load is waited for
        before the prefix is recomputed."""
        if not isinstance(cache, CacheAPI):
            raise ArgumentError(f"cache must implement ucm.api.CacheAPI, got {type(cache).__name__}")
        self.model = model
        self._cache = cache
        bt = block_tokens or getattr(getattr(cache, "config", None), "block_tokens", None) or DEFAULT_BLOCK_TOKENS
        self.namespace, self.layout = build_namespace(model, int(bt), model_id, salt)
        # The config the engine-side accelerators are built from (module docstring).
        config = getattr(cache, "config", None)
        self.settings: UcmConfig = config if isinstance(config, UcmConfig) else UcmConfig()
        self.accelerators = Accelerators.build(self.settings, cache, runs_in="engine")
        self.sparse: Optional[SparseAccelerator] = self.accelerators.get(SparseAccelerator)
        self.device = torch.device(model.device)
        self.dtype = model.dtype
        self._guard = CallGuard(log)
        nbytes = fronts.front_bytes(hbm_bytes, self.device.type)
        if nbytes and fronts.has_hbm_tier(cache):
            if hbm_bytes:
                raise ConfigError("hbm_bytes: the cache has an hbm tier already; give hbm_bytes=0 or a cache "
                                  "without one")
            nbytes = 0
        self.front = (fronts.make_front(nbytes, self.device, self.layout.block_tokens, fronts.policy_of(cache))
                      if nbytes else None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucm-hf-store")
        self._lock = threading.Lock()
        self._inflight: list[tuple[Handle, Any]] = []  # store handles and the sources they read
        self._jobs: list[Any] = []  # futures of store jobs not yet done
        # Sparse decode's hooks (sparse.py): called on the store thread with (keys, CPU payload) before a store;
        # the UCMCache of the `generate` call under way.
        self.block_observer: Optional[Any] = None
        self.generating: Optional[UCMCache] = None
        self._restorer = Restorer(self.layout, cache=cache, front=self.front, device=self.device, dtype=self.dtype,
                                  timeout_s=float(timeout_s), guard=self._guard)
        self._guard.call("register_layout", lambda: cache.register_layout(self.layout.kv_layout()))
        self.sparse_decoder: Optional[SparseDecoder] = None  # of `sparse`: what `generate` decodes with
        self._blender: Optional[ChunkBlender] = None
        if self.sparse is not None:
            try:
                self.sparse_decoder = SparseDecoder(self, sparse=self.sparse)
            except BaseException:
                self.close()
                raise

    @property
    def blender(self) -> "ChunkBlender":
        """The ChunkBlender of this connector (built on first use)."""
        if self._blender is None:
            self._blender = ChunkBlender(self)
        return self._blender

    @property
    def shared_cache(self) -> CacheAPI:
        """The cache this connector was given (behind the hbm front, if any)."""
        return self._cache

    # ---- before prefill -------------------------------------------------------
    def cache_for(self, input_ids: Any, attention_mask: Any = None) -> UCMCache:
        """A UCMCache for `input_ids` (`[batch, seq]`, left-padded as the
        `attention_mask` says; default no padding) holding the longest
        cached prefix every row shares."""
        return self._cache_for(input_ids, attention_mask, defer=False)

    def _cache_for(self, input_ids: Any, attention_mask: Any, defer: bool) -> UCMCache:
        """`cache_for`; `defer`: streamed layers after the first are copied
        by the first forward (restore.DeferredLayers; `generate` only)."""
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 1:
            ids = ids.unsqueeze(0)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ArgumentError(f"input_ids must be [batch, seq] with seq > 0, got shape {tuple(ids.shape)}")
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if mask.shape != ids.shape:
            raise ArgumentError(f"attention_mask shape {tuple(mask.shape)} is not input_ids' {tuple(ids.shape)}")
        ids_np, mask_np = ids.cpu().numpy(), mask.cpu().numpy().astype(bool)
        batch, length = ids_np.shape
        bt = self.layout.block_tokens
        rows = []
        req = next(_ids)
        for b in range(batch):
            real = int(mask_np[b].sum())
            pad = length - real
            valid = real > 0 and bool(mask_np[b, pad:].all())
            if not valid:
                self._guard.warn_once("padding", "ucm: a prompt that is not left-padded is neither restored nor stored")
            keys = block_keys(self.namespace, ids_np[b, pad:]) if valid else []
            rows.append(PromptRow(pad, keys, f"hf-{os.getpid()}-{req}-{b}", valid))
        cache = UCMCache(rows, length, self.layout.num_layers, on_forward=self._after_forward,
                         on_finish=self._finish, store_after_token=defer)
        self._guard.count("requests", 1)
        for r in rows:
            if r.valid and r.keys:
                self._guard.call("begin_request", lambda r=r: self._cache.begin_request(r.request_id, r.keys))
                if self.front is not None:
                    self._guard.call("begin_request", lambda r=r: self.front.begin_request(r.request_id, r.keys))
        front_hits = [self._lookup(self.front, r) for r in rows]
        for r, fh in zip(rows, front_hits):
            r.hit = max(fh, self._lookup(self._cache, r))
            r.stored = r.hit
        # The common restored length: every row's padding plus at most its cached tokens.
        target = min(length - 1, min((r.pad + r.hit * bt) if r.valid else 0 for r in rows))
        if target > 0:
            restored = self._restorer.restore(rows, front_hits, target, length, defer=defer)
            if restored is not None:
                cache.adopt(restored)
            target = restored.length if restored is not None else 0
        cache.expect_new(length - target)
        self._guard.count("lookup_blocks", sum(len(r.keys) for r in rows))
        self._guard.count("hit_blocks", sum(r.hit for r in rows))
        self._guard.count("restored_tokens", sum(max(0, target - r.pad) for r in rows))
        return cache

    def _lookup(self, source: Optional[CacheAPI], row: PromptRow) -> int:
        if source is None or not row.valid or not row.keys:
            return 0
        n = self._guard.call("lookup", lambda: source.lookup(row.keys), default=0)
        return n if isinstance(n, int) and 0 <= n <= len(row.keys) else 0

    # ---- after a forward --------------------------------------------------------
    def _after_forward(self, cache: UCMCache) -> None:
        """Schedules the store of every prompt block the layers now hold
        completely and that is not cached yet (called after the last
        layer's update of each forward)."""
        bt = self.layout.block_tokens
        seq = cache.layers[0].get_seq_length()
        jobs = []
        rows = cache.rows
        for b, r in enumerate(rows):
            if not r.valid:
                continue
            full = min(len(r.keys), max(0, seq - r.pad) // bt)
            if full > r.stored:
                jobs.append((b, r.stored, full))
                r.stored = full
        if all(not r.valid or r.stored >= len(r.keys) for r in rows):
            cache.stop_storing()
        if not jobs:
            return
        ks = [layer.keys for layer in cache.layers]
        vs = [layer.values for layer in cache.layers]
        if ks[0].shape[0] != len(rows):
            log.error("ucm: the batch changed size (%d rows, made for %d); nothing more of it is stored",
                      ks[0].shape[0], len(rows))
            cache.stop_storing()
            return
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        fut = self._pool.submit(self._store_job, rows, jobs, ks, vs, event)
        with self._lock:
            self._jobs = [f for f in self._jobs if not f.done()] + [fut]

    def _store_job(self, rows: list[PromptRow], jobs: list, ks: list, vs: list, event: Any) -> None:
        """On the store thread: gathers blocks into payloads and stores them
        (front first, then the shared cache). The layer tensors are never
        written again below the length they had (layers.SpareLayer)."""
        lay, bt = self.layout, self.layout.block_tokens
        try:
            if event is not None:
                event.synchronize()
            for b, first, last in jobs:
                r, n = rows[b], last - first
                payload = torch.empty((n, *lay.shape), dtype=self.dtype, device=self.device)
                with torch.no_grad():
                    gather_blocks(ks, vs, b, r.pad + first * bt, n, bt, payload)
                keys, parent = r.keys[first:last], (r.keys[first - 1] if first else None)
                if self.front is not None:
                    self._guard.call("store", lambda: self.front.store(keys, [payload[i] for i in range(n)],
                                                                       parent=parent, request_id=r.request_id))
                host = payload if self.device.type == "cpu" else payload.to("cpu")
                if self.block_observer is not None:
                    self._guard.call("block_observer", lambda: self.block_observer(keys, host))
                handle = self._guard.call("store", lambda: self._cache.store(keys, [host[i] for i in range(n)],
                                                                             parent=parent, request_id=r.request_id))
                if handle is not None:
                    handle.add_done_callback(self._stored)
                    with self._lock:
                        self._inflight = [(h, s) for h, s in self._inflight if not h.done()] + [(handle, host)]
        except Exception:
            self._guard.fault("store", "ucm: storing blocks failed; they are not cached")

    def _stored(self, handle: Handle) -> None:
        out = handle.results
        ok = sum(1 for o in out if o is Outcome.DONE)
        self._guard.count("stored_blocks", ok)
        self._guard.count("store_failed_blocks", len(out) - ok)

    def _finish(self, cache: UCMCache, output_tokens: int) -> None:
        rows = cache.rows

        def job() -> None:
            for r in rows:
                if r.valid and r.keys:
                    self._guard.call("finish", lambda r=r: self._cache.finish(r.keys, output_tokens, r.request_id))
                    if self.front is not None:
                        self._guard.call("finish", lambda r=r: self.front.finish(r.keys, output_tokens, r.request_id))

        try:
            fut = self._pool.submit(job)
        except RuntimeError:  # closed
            return
        with self._lock:
            self._jobs = [f for f in self._jobs if not f.done()] + [fut]

    # ---- the convenience call and the rest -----------------------------------
    def generate(self, input_ids: Any, attention_mask: Any = None, chunks: Any = None, **kwargs: Any) -> Any:
        """`model.generate(input_ids, attention_mask=..., past_key_values=
        self.cache_for(...), **kwargs)`, then `finish`. Returns what generate
        returns. With `chunks` (spans [start, end) of one prompt's retrieved
        passages), the chunks are reused wherever they sit (blend.py, the
        `blend` accelerator's options) and the prefix path is not used.
        Unlike `cache_for`, a prefix streamed from the cache is copied layer
        by layer inside the prefill (restore.DeferredLayers),
        so blocks read from NVMe overlap the model's compute; a block that
        fails after prefill began makes generate start again without it.
        With the `sparse` accelerator enabled, decoded sparsely (module
        docstring)."""
        if chunks is not None:
            return self.blender.generate(input_ids, chunks, attention_mask=attention_mask, **kwargs)
        if self.sparse_decoder is not None:
            with self.sparse_decoder.decoding():
                return self._generate(input_ids, attention_mask, **kwargs)
        return self._generate(input_ids, attention_mask, **kwargs)

    def _generate(self, input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
        if "past_key_values" in kwargs:
            raise ArgumentError("generate: past_key_values is the connector's; use cache_for for a cache of your own")
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 1:
            ids = ids.unsqueeze(0)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        cache = self.generating = self._cache_for(ids, mask, defer=True)
        out = None
        try:
            try:
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          past_key_values=cache, **kwargs)
            except RestoreFault:  # raised in the first forward, before any token: recompute the prompt
                self._guard.fault("restore", "ucm: a restored block did not land during prefill; the prompt is "
                                  "recomputed")
                cache = self.generating = cache.recompute()
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          past_key_values=cache, **kwargs)
        finally:
            self.generating = None
            cache.drop_deferred()
            cache.store_due()
            seqs = getattr(out, "sequences", out)
            cache.finish(int(seqs.shape[1] - ids.shape[1]) if isinstance(seqs, torch.Tensor) else None)
        return out

    def wait_stores(self, timeout_s: float = 60.0) -> bool:
        """Waits until every store and finish submitted so far is done."""
        import time

        deadline = time.monotonic() + timeout_s
        with self._lock:
            jobs = list(self._jobs)
        for f in jobs:
            try:
                f.result(max(0.0, deadline - time.monotonic()))
            except Exception:
                return False
        with self._lock:
            handles = [h for h, _ in self._inflight]
        for h in handles:
            if h.wait(max(0.001, deadline - time.monotonic())) is None:
                return False
        with self._lock:
            self._inflight = [(h, s) for h, s in self._inflight if not h.done()]
        return self._blender is None or self._blender.wait_stores(max(0.001, deadline - time.monotonic()))

    def stats(self) -> dict[str, Any]:
        """The connector's counters (a snapshot): requests, blocks looked up,
        hit, restored, stored and failed, and faults; with engine-side
        accelerators, theirs under `accelerators` (by name)."""
        out = self._guard.counts()
        if self.accelerators:
            out["accelerators"] = self.accelerators.stats()
        return out

    def close(self) -> None:
        """Waits for the stores in flight and closes the hbm front and the
        engine-side accelerators (never the cache it was given)."""
        self.wait_stores()
        self._pool.shutdown(wait=True)
        if self.front is not None:
            self.front.close()
        self.accelerators.close()
