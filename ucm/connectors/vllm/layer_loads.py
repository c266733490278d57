"""LayerLoads: the worker's streamed loads of one step (LoadJob.stream), in
each vLLM worker process, on vLLM's worker thread.

`start` (from start_load_kv, before the forward) asks the cache for a
stream per job (`LayerStreams.stream_slots`): the cache starts reading
every layer of the blocks below DRAM at once and returns slots at once.
`wait_layer` (from wait_for_layer_load, inside attention layer l) waits
only for layer l of those blocks, then copies that layer's pages into
vLLM's KV tensors, so the forward of layer l runs while later layers are
still being read. A block that does not land (missing, a corrupt or failed
range, a dead service, past `load_timeout_s` counted from `start`) stops
the copies at it: it and every later block of the request are reported in
`finish` (from wait_for_save, after the forward) as load errors, vLLM
recomputes them, and the request saves nothing this step. Nothing here
raises into vLLM, and no wait outlasts the stream's deadline.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ucm.api import Outcome
from ucm.connectors.kv_pages import SKIP
from ucm.connectors.vllm.metadata import LoadJob
from ucm.layer_stream import LayerStream

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Active:
    job: LoadJob
    stream: Optional[LayerStream]
    deadline: float
    good: int  # leading blocks every layer so far landed for (and was copied)
    next_layer: int = 0
    waited_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class LayerLoads:
    """This step's streamed loads; see the module docstring."""

    def __init__(self, cache: Any, copy: Callable[..., None], blocks: Callable[[list, int, list], list],
                 block_bytes: Callable[[], int], layers: Callable[[], int], timeout_s: float, threads: int) -> None:
        """`copy(blocks, arena, layer)` copies one layer of (offset, page ids)
        blocks into the KV tensors; `blocks(page_ids, first, slots)` makes
        those pairs (the worker's); `block_bytes()` and `layers()` read the
        registered layout."""
        self._cache = cache
        self._copy = copy
        self._blocks = blocks
        self._block_bytes = block_bytes
        self._layers = layers
        self._timeout_s = timeout_s
        self._threads = threads
        self._active: list[_Active] = []
        self.counters = {"streamed_blocks": 0, "stream_failed_blocks": 0, "stream_wait_s": 0.0, "streams": 0}

    def __bool__(self) -> bool:
        return bool(self._active)

    def start(self, job: LoadJob) -> None:
        n = len(job.keys)
        deadline = time.monotonic() + self._timeout_s
        try:
            bb = self._block_bytes()
            s = self._cache.stream_slots(job.keys, [bb] * n, self._layers(), request_id=job.req_id)
        except Exception:  # a cache fault is a miss for vLLM, never an exception
            log.exception("UCMConnector: starting the streamed load of %s failed", job.req_id)
            s = None
        good = n if s is not None else 0
        if s is not None:
            good = next((i for i, slot in enumerate(s.slots[:n]) if slot is None), n)
        self._active.append(_Active(job, s, deadline, good))
        self.counters["streams"] += 1

    def wait_layer(self, layer: int) -> None:
        """Layer `layer` of every active stream: waits for it, copies it."""
        for a in self._active:
            if a.stream is None or a.next_layer != layer:
                if a.next_layer != layer:  # a layer skipped or repeated: nothing of it is trusted
                    a.good = 0
                continue
            a.next_layer = layer + 1
            if a.good == 0:
                continue
            t0 = time.perf_counter()
            try:
                landed = a.stream.wait_layer(layer, max(0.0, a.deadline - time.monotonic()))
                a.good = min(a.good, next((i for i, ok in enumerate(landed) if not ok), len(landed)))
                a.waited_s += time.perf_counter() - t0
                if a.good:
                    blocks = self._blocks(a.job.page_ids, 0, a.stream.slots[:a.good])
                    self._copy(blocks, a.stream.arena, layer)
            except Exception:
                log.exception("UCMConnector: layer %d of the streamed load of %s failed", layer, a.job.req_id)
                a.good = 0

    def finish(self) -> tuple[set[int], set[str], int]:
        """After the forward: (pages that did not load, requests whose load
        lost blocks, blocks loaded); releases every stream."""
        bad: set[int] = set()
        tainted: set[str] = set()
        loaded = 0
        layers = self._layers()
        active, self._active = self._active, []
        for a in active:
            n = len(a.job.keys)
            good = a.good if a.next_layer == layers else 0  # a layer never waited for ran over missing KV
            if a.stream is not None:
                try:
                    if good:
                        out = a.stream.outcomes(max(1.0, a.deadline - time.monotonic()))
                        good = min(good, next((i for i, o in enumerate(out) if o is not Outcome.DONE), len(out)))
                except Exception:
                    log.exception("UCMConnector: finishing the streamed load of %s failed", a.job.req_id)
                    good = 0
                finally:
                    try:
                        a.stream.release()
                    except Exception:
                        log.exception("UCMConnector: releasing a streamed load failed")
            loaded += good
            self.counters["streamed_blocks"] += good
            self.counters["stream_failed_blocks"] += n - good
            self.counters["stream_wait_s"] += a.waited_s
            if good < n:
                bad |= {p for pages in a.job.page_ids[good:] for p in pages if p != SKIP}
                tainted.add(a.job.req_id)
                log.warning("UCMConnector: %d of %d streamed blocks of %s did not load; vLLM recomputes them",
                            n - good, n, a.job.req_id)
        return bad, tainted, loaded
