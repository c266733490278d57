"""UCMWorkerSide: the worker half of UCMConnector, in each vLLM worker
process.

It copies whole vLLM pages, every layer, verbatim between vLLM's paged KV
tensors and the arena slots the cache leases or reserves (`CacheAPI.read_slots`
/ `write_slots`): a block's payload is, for each layer, its pages in order,
each page its byte chunks in memory order (`kv_pages`); K and V are never
re-interpreted. The copies go through a `kv_pages.PageCopier`:
`cpu_pages.NativePageCopier` for CPU tensors, `torch_pages.TorchPageCopier`
for CUDA ones.

Threads and blocking:
- vLLM's worker thread calls every public method. `start_load_kv` copies
  synchronous loads (blocks already in DRAM) before the forward and never
  waits there for a save in flight; asynchronous loads and every save run
  on a background pool of two threads and are reported through
  `get_finished`; the loads of P/D's decode steps (`LoadJob.wait_s`),
  which may wait for another engine's saves, run on a pool of their own
  so that they never hold up this engine's saves.
- A save holds the request's pages until reported; `handle_preemptions`
  takes them back at once (`PageGuard`, page_guard.py: it waits only for
  a copy in progress; a save not yet copied is dropped, never committed).
- Loads that lose blocks report their pages through
  `get_block_ids_with_load_errors` (vLLM recomputes them); a step whose
  synchronous load lost blocks saves nothing of that request.
- Lock order: a guard's lock, then `_lock` (which guards the job tables).

Every load and save passes its request's id to the cache. Any exception
from the cache is logged and counted as lost blocks, never raised into
vLLM.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch

from ucm.api import CacheAPI, Key, Outcome
from ucm.connectors.kv_pages import SKIP, PageCopier, PageLayout
from ucm.connectors.torch_pages import TorchPageCopier, page_views
from ucm.connectors.vllm.layer_loads import LayerLoads
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata
from ucm.connectors.vllm.page_guard import PageGuard, PagesRevoked
from ucm.connectors.vllm.settings import ConnectorSettings
from ucm.errors import ConfigError
from ucm.layer_stream import LayerStreams

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

# (per layer: its whole storage as a flat uint8 tensor, per layer: where its
# pages lie, pages per block) -> the copier for those tensors
CopierFactory = Callable[[Sequence[torch.Tensor], Sequence[PageLayout], int], PageCopier]


def default_copier(storages: Sequence[torch.Tensor], layouts: Sequence[PageLayout], pages_per_block: int) -> PageCopier:
    """Native memcpys for CPU tensors, torch copies for device tensors."""
    if storages[0].device.type == "cpu":
        from ucm.connectors.vllm.cpu_pages import NativePageCopier

        return NativePageCopier(storages, layouts, pages_per_block)
    return TorchPageCopier(storages, layouts, pages_per_block)


class UCMWorkerSide:
    """Loads and saves of whole pages for one worker; see the module docstring."""

    def __init__(self, cache: CacheAPI, *, pages_per_block: int, settings: ConnectorSettings = ConnectorSettings(),
                 num_kv_blocks: Optional[int] = None, block_strides: Optional[Mapping[str, int]] = None,
                 copier_factory: CopierFactory = default_copier, copy_threads: Optional[int] = None) -> None:
        """`pages_per_block`: vLLM pages per ucm block. `num_kv_blocks`: the
        size of the page dimension of every layer tensor (vLLM's
        `KVCacheConfig.num_blocks`; None: each tensor's first dimension);
        `block_strides`: per layer name, the engine's byte stride between
        blocks where it states one (tells apart dimensions of that size).
        `copier_factory` builds the page copier at `register_kv_caches`.
        `copy_threads`: threads a synchronous load may copy with (default
        up to 4 of this process's CPUs)."""
        if not isinstance(pages_per_block, int) or pages_per_block < 1:
            raise ConfigError(f"pages_per_block must be an int >= 1, got {pages_per_block!r}")
        self._cache = cache
        self.settings = settings
        self.pages_per_block = pages_per_block
        self._num_kv_blocks = num_kv_blocks
        self._block_strides = dict(block_strides or {})
        self._copier_factory = copier_factory
        self._copier: Optional[PageCopier] = None  # set by register_kv_caches
        self._layouts: list[PageLayout] = []  # per layer (in layer order): where its pages lie
        self._page_bytes = 0
        self._num_pages = 0
        self._copy_threads = copy_threads or max(1, min(4, len(os.sched_getaffinity(0))))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ucm-vllm")
        self._pd_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ucm-vllm-pd")
        # req_id -> background jobs touching its pages, each with its hold on them
        self._inflight: dict[str, list[tuple[Future, PageGuard]]] = {}
        self._saves: dict[Key, Future] = {}  # block key -> the save in flight writing it
        self._pending_saves: dict[str, int] = {}  # req_id -> saves not yet done
        self._saving_reqs: set[str] = set()  # every request that got a save
        self._finished_saving: set[str] = set()  # finished by vLLM, waiting for saves
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._tainted: set[str] = set()  # requests whose synchronous load failed this step
        self._layer_index: dict[str, int] = {}  # layer name -> its place in the payload
        self._streams = LayerLoads(cache, self._copy_layer, self._blocks, lambda: self.block_bytes,
                                   lambda: len(self._layouts), settings.load_timeout_s, self._copy_threads)
        self.counters = {"loaded_blocks": 0, "load_failed_blocks": 0, "stored_blocks": 0,
                         "store_failed_blocks": 0, "abandoned_blocks": 0, "tainted_blocks": 0,
                         "load_s": 0.0, "store_s": 0.0, "pd_wait_s": 0.0, "pd_late_blocks": 0}

    @classmethod
    def from_vllm(cls, kv_cache_config: "KVCacheConfig", pages_per_block: int, settings: ConnectorSettings,
                  cache: CacheAPI) -> "UCMWorkerSide":
        strides = {name: t.block_stride for t in getattr(kv_cache_config, "kv_cache_tensors", ()) or ()
                   for name in getattr(t, "layers", ())}
        return cls(cache, pages_per_block=pages_per_block, settings=settings,
                   num_kv_blocks=getattr(kv_cache_config, "num_blocks", None) or None, block_strides=strides)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload (0 before register_kv_caches)."""
        return len(self._layouts) * self.pages_per_block * self._page_bytes

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Finds, per layer, the dimension indexing vLLM's pages and the byte
        chunks of a page (`kv_pages.page_layout`), and builds the copier
        over them. Refuses (ConfigError) tensors on several or other
        devices, layouts without contiguous chunks, unequal page sizes."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        first = kv_caches[names[0]]
        num_blocks = self._num_kv_blocks or first.shape[0]
        devices = {kv_caches[n].device for n in names}
        if len(devices) != 1 or next(iter(devices)).type not in ("cpu", "cuda"):
            raise ConfigError(f"UCMConnector copies KV tensors on one CPU or CUDA device, "
                              f"got {sorted(map(str, devices))}")
        layouts, page_dims, storages = page_views([(n, kv_caches[n]) for n in names], num_blocks,
                                                  self._block_strides)
        self._copier = self._copier_factory(storages, layouts, self.pages_per_block)
        self._layouts = layouts
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._page_bytes = layouts[0].page_bytes
        # The codecs of the tiers below DRAM read K and V by it.
        self._register_kv_layout(first, page_dims[0], layouts[0], len(names))
        self._num_pages = min(lay.num_pages for lay in layouts)
        log.info("UCMConnector worker: %d layers on %s, %d pages of %d bytes in %d chunk(s) (layer tensor %s %s "
                 "strides %s); block payload %d bytes; copies by %s", len(layouts), first.device, self._num_pages,
                 self._page_bytes, len(layouts[0].chunks), tuple(first.shape), first.dtype, first.stride(),
                 self.block_bytes, type(self._copier).__name__)

    def _register_kv_layout(self, first: torch.Tensor, page_dim: int, page: PageLayout, num_layers: int) -> None:
        """The CPU backend's layout, else (a device backend, or a CPU page
        this code does not know) an opaque one: a lossy codec then never
        reads these blocks as another engine's layout of the same size."""
        from ucm.codecs.layout import opaque_layout
        from ucm.connectors.vllm.cpu_pages import cpu_kv_layout

        kv = cpu_kv_layout(first, page_dim, page, num_layers, self.pages_per_block) \
            if first.device.type == "cpu" else None
        try:
            kv = kv if kv is not None else opaque_layout(self.block_bytes)
            self._cache.register_layout(kv)
        except Exception:  # a cache fault: blocks are stored without a lossy codec, never an engine error
            log.warning("UCMConnector worker: registering the KV layout failed", exc_info=True)

    # ---- page copies ----------------------------------------------------------
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

    # ---- loads ---------------------------------------------------------------
    def _load(self, job: LoadJob, ready: Any = None, guard: Optional[PageGuard] = None) -> bool:
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
        guard = guard if guard is not None else PageGuard()
        n = len(job.keys)
        ok = 0
        # Synchronous loads hold up the forward, whose threads are idle meanwhile.
        threads = 1 if job.is_async else self._copy_threads

        def fill(first: int, slots: list, arena: Any) -> None:
            with guard.pages():
                self._copier.copy(False, self._blocks(job.page_ids, first, slots), arena, ready, threads=threads)

        try:
            if job.is_async:
                self._wait_saves(job.keys)
                if job.wait_s > 0:
                    self._wait_committed(job.keys, job.wait_s, guard)
            if not guard.revoked:
                results = self._cache.read_slots(job.keys, [self.block_bytes] * n, fill, request_id=job.req_id)
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
        except PagesRevoked:
            with self._lock:
                self.counters["abandoned_blocks"] += n
            log.info("UCMConnector: load for %s abandoned: the request was preempted", job.req_id)
            return False
        if bad:
            log.warning("UCMConnector: %d of %d blocks of %s did not load; vLLM recomputes them", n - ok, n,
                        job.req_id)
        return not bad

    def _wait_committed(self, keys: list[Key], wait_s: float, guard: PageGuard) -> None:
        """Waits, at most `wait_s`, until the cache holds every one of `keys`
        (blocks another engine is still saving: P/D's decode step), and no
        longer once the service is gone; the ones that do not come are load
        errors after the read."""
        started = time.monotonic()
        deadline, pause = started + wait_s, 0.001
        held = 0
        while not guard.revoked:
            try:
                held = self._cache.lookup(keys)
            except Exception:  # a cache fault: the read that follows reports what is there
                log.warning("UCMConnector: lookup while waiting for a prefill engine's blocks failed",
                            exc_info=True)
                break
            now = time.monotonic()
            if held >= len(keys) or now >= deadline or self._service_gone():
                break
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, 0.02)
        with self._lock:
            self.counters["pd_wait_s"] += time.monotonic() - started
            self.counters["pd_late_blocks"] += len(keys) - held

    def _service_gone(self) -> bool:
        """Whether the cache is a service's client with no link to it and
        none to be had now (the service died): the blocks waited for cannot
        come, and the request is better computed at once."""
        if getattr(self._cache, "connected", True):  # an in-process cache, or a live link
            return False
        try:
            return not self._cache.try_connect()
        except Exception:  # closed: nothing will come either
            return True

    def _load_async(self, job: LoadJob, ready: Any, guard: PageGuard) -> None:
        try:
            self._load(job, ready, guard)
        finally:
            with self._lock:
                self._done_recving.add(job.req_id)

    def start_load_kv(self, meta: Optional[UCMConnectorMetadata]) -> None:
        """Before the forward: runs this step's synchronous loads, submits
        the asynchronous ones."""
        self._tainted = set()  # a step's mark, never the next step's
        if self._streams:  # a step whose wait_for_save never came: its streams are not trusted
            self._finish_streams()
        if not isinstance(meta, UCMConnectorMetadata) or not meta.loads or self._copier is None:
            return
        # Pages given to these requests may still be in use by kernels queued
        # earlier (a request that just finished): on CUDA, loads wait for them.
        ready = self._copier.record_ready()
        for job in meta.loads:
            if job.stream and not job.is_async and isinstance(self._cache, LayerStreams):
                self._streams.start(job)  # copied layer by layer in wait_for_layer_load
            elif job.is_async:
                guard = PageGuard()
                pool = self._pd_pool if job.wait_s > 0 else self._pool
                self._track(job.req_id, pool.submit(self._load_async, job, ready, guard), guard)
            elif not self._load(job, ready):
                # This step's forward runs over the pages that did not arrive:
                # whatever it computes for the request is not saved.
                self._tainted.add(job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Inside attention layer `layer_name`: this step's streamed loads
        of that layer landed and copied (LayerLoads)."""
        if self._streams:
            layer = self._layer_index.get(layer_name)
            if layer is not None:
                self._streams.wait_layer(layer)

    def _copy_layer(self, blocks: list, arena: Any, layer: int) -> None:
        self._copier.copy(False, blocks, arena, None, threads=self._copy_threads, layers=[layer])

    def _finish_streams(self) -> None:
        """After the forward: the streamed loads' lost pages become load
        errors and their requests save nothing this step."""
        started = time.perf_counter()
        bad, tainted, loaded = self._streams.finish()
        self._tainted |= tainted
        with self._lock:
            self._load_errors |= bad
            self.counters["loaded_blocks"] += loaded
            self.counters["load_s"] += time.perf_counter() - started

    # ---- saves ---------------------------------------------------------------
    def wait_for_save(self, meta: Optional[UCMConnectorMetadata]) -> None:
        """After the forward (it has written the pages): ends this step's
        streamed loads, then submits its saves; they run in the background
        and hold the request's pages until reported."""
        if self._streams:
            self._finish_streams()
        if not isinstance(meta, UCMConnectorMetadata) or not meta.stores or self._copier is None:
            return
        # On CUDA the forward may still be running: saves wait for this event.
        ready = self._copier.record_ready()
        tainted, self._tainted = self._tainted, set()
        for job in meta.stores:
            if job.req_id in tainted:  # computed over pages a failed load left: never stored
                with self._lock:
                    self._saving_reqs.add(job.req_id)  # still reported in finished_sending
                    self.counters["tainted_blocks"] += len(job.keys)
                log.warning("UCMConnector: %d blocks of %s not saved: this step computed them over pages "
                            "that did not load", len(job.keys), job.req_id)
                continue
            guard = PageGuard()
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

    def _save(self, job: StoreJob, ready: Any = None, guard: Optional[PageGuard] = None) -> None:
        """Copies the job's pages into reserved slots, then the cache commits
        them. `guard`: the save's hold on the pages; a chunk whose copy finds
        it revoked is aborted (never committed with bytes of pages that may
        have been reused), and so are the chunks after it."""
        started = time.perf_counter()
        guard = guard if guard is not None else PageGuard()
        stored = 0

        def fill(first: int, slots: list, arena: Any) -> None:
            with guard.pages():
                self._copier.copy(True, self._blocks(job.page_ids, first, slots), arena, ready, threads=1)

        try:
            if not guard.revoked:
                results = self._cache.write_slots(job.keys, [self.block_bytes] * len(job.keys), fill,
                                                  parent=job.parent, request_id=job.req_id)
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

    def _track(self, req_id: str, fut: Future, guard: PageGuard) -> None:
        with self._lock:
            jobs = [(f, g) for f, g in self._inflight.get(req_id, ()) if not f.done()]
            jobs.append((fut, guard))
            self._inflight[req_id] = jobs

    def handle_preemptions(self, meta: Optional[UCMConnectorMetadata]) -> None:
        """Preempted requests' pages are about to be reused (vLLM calls this
        before the step that may hand them to other requests). Takes the
        pages back from their background jobs without waiting for their
        I/O: only a copy in progress is waited for (one memcpy of at most a
        client chunk). A save that had copied its pages commits them; one
        that had not is dropped (a later miss); a load writes no page and
        reports no error from then on."""
        if not isinstance(meta, UCMConnectorMetadata):
            return
        for req_id in meta.preempted:
            with self._lock:
                jobs = self._inflight.pop(req_id, [])
            for _, guard in jobs:
                guard.revoke()

    # ---- completion ------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(requests whose saves are all done, now that vLLM finished them;
        requests whose asynchronous load is done), None for an empty set."""
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

    def add_load_errors(self, page_ids: list[int]) -> None:
        """Pages another part of the connector failed to fill this step (a
        blend): reported with the loads' errors, so vLLM recomputes them."""
        with self._lock:
            self._load_errors |= set(page_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._load_errors = self._load_errors, set()
        return bad

    def shutdown(self) -> None:
        """Waits for the saves in flight (they finish before the engine
        goes), then lets the copier go."""
        if self._streams:
            self._finish_streams()
        self._pd_pool.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True)
        log.info("UCMConnector worker: %s %s", self.counters, self._streams.counters)
        if self._copier is not None:
            self._copier.close()  # unregisters the pinned arena(s)
