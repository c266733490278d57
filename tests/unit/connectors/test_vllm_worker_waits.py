"""The worker half of UCMConnector never holds vLLM's step on ucm for long:
a synchronous load does not wait for a save in flight, and
handle_preemptions does not wait for background copies beyond one copy in
progress; a save that had not copied its pages when their request was
preempted commits nothing (its pages may hold another request's KV by the
time it would copy them).

Interleavings are forced with events; the only time limits below are
generous liveness bounds (a call that should return at once must return
within JOIN_S), never performance assertions."""
import threading
import time

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from connector_fakes import JOIN_S, FakeCache  # noqa: E402
from ucm.connectors.torch_pages import TorchPageCopier  # noqa: E402
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata  # noqa: E402
from ucm.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from ucm.connectors.vllm.worker import UCMWorkerSide, default_copier  # noqa: E402

B, L, PPB = 10, 2, 2  # KV blocks, layers, pages per ucm block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


class GatedCopier:
    """Wraps the worker's page copier: each copy sets `started`, then waits
    for `gate` (a copy in progress, held open by the test)."""

    def __init__(self, inner):
        self.inner, self.started, self.gate = inner, threading.Event(), threading.Event()

    def copy(self, *args, **kwargs):
        self.started.set()
        assert self.gate.wait(JOIN_S)
        self.inner.copy(*args, **kwargs)

    def record_ready(self):
        return None

    def close(self):
        self.inner.close()


def _worker(copier_factory=default_copier, **settings):
    cache = FakeCache()
    w = UCMWorkerSide(cache, pages_per_block=PPB, num_kv_blocks=B, settings=ConnectorSettings(**settings),
                      copier_factory=copier_factory)
    kv = {n: torch.randn(B, 2, 16, 64).to(torch.bfloat16) for n in NAMES}
    w.register_kv_caches(kv)
    return w, cache, kv


def _page_bytes(kv, pages):
    return b"".join(kv[n][p].contiguous().view(torch.uint8).numpy().tobytes() for n in NAMES for p in pages)


def _in_thread(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def _save(w, req_id, key, pages):
    w.wait_for_save(UCMConnectorMetadata(stores=[StoreJob(req_id, [key], [pages], None)]))


def _step(w, loads=(), stores=()):
    """One engine step as vLLM drives the worker: start_load_kv before the
    forward, wait_for_save after it."""
    meta = UCMConnectorMetadata(loads=list(loads), stores=list(stores))
    w.start_load_kv(meta)
    w.wait_for_save(meta)


def test_sync_load_does_not_wait_for_a_save_in_flight():
    w, cache, kv = _worker(load_timeout_s=3600.0)
    gate = cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(w, "r1", a, [1, 2])
    assert cache.reserving.wait(JOIN_S)
    before = {n: kv[n].clone() for n in NAMES}
    t = _in_thread(w.start_load_kv, UCMConnectorMetadata(loads=[LoadJob("r2", [a], [[5, 6]], False)]))
    t.join(JOIN_S)
    assert not t.is_alive(), "a synchronous load (in the forward) waited for a save"
    assert not gate.is_set()
    assert w.get_block_ids_with_load_errors() == {5, 6}  # not there yet: vLLM recomputes it
    for n in NAMES:
        assert torch.equal(kv[n], before[n])
    gate.set()
    w.shutdown()
    assert cache.blob(a) == _page_bytes(kv, [1, 2])


def test_async_load_still_waits_for_the_save_it_follows():
    w, cache, kv = _worker()
    gate = cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(w, "r1", a, [1, 2])
    want = {n: kv[n][1:3].clone() for n in NAMES}
    w.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("r2", [a], [[5, 6]], True)]))
    assert w.get_finished(set()) == (None, None)  # still waiting for the save
    gate.set()
    w.shutdown()  # waits for the pool
    assert w.get_finished(set()) == (None, {"r2"})
    assert w.get_block_ids_with_load_errors() == set()
    for n in NAMES:
        assert torch.equal(kv[n][5:7], want[n])


def test_an_async_load_gives_up_on_a_save_after_the_timeout_and_reports_its_pages():
    w, cache, kv = _worker(load_timeout_s=0.05)
    gate = cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(w, "r1", a, [1, 2])
    assert cache.reserving.wait(JOIN_S)
    w.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("r2", [a], [[5, 6]], True)]))
    deadline = time.monotonic() + JOIN_S
    recving = set()
    while "r2" not in recving:
        assert time.monotonic() < deadline, "the asynchronous load never finished"
        time.sleep(0.01)
        recving = w.get_finished(set())[1] or set()
    assert not gate.is_set()  # it finished while the save still waited
    assert w.get_block_ids_with_load_errors() == {5, 6}
    gate.set()
    w.shutdown()


def test_preemption_does_not_wait_for_a_save_that_has_not_copied_and_it_commits_nothing():
    w, cache, kv = _worker()
    gate = cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(w, "r1", a, [1, 2])
    assert cache.reserving.wait(JOIN_S)  # the save is in its (slow) reserve call
    t = _in_thread(w.handle_preemptions, UCMConnectorMetadata(preempted={"r1"}))
    t.join(JOIN_S)
    assert not t.is_alive(), "handle_preemptions waited for a save's I/O"
    for n in NAMES:  # vLLM gives the pages to another request, which writes them
        kv[n][1:3] = 7
    gate.set()
    w.shutdown()
    assert a not in cache.slots  # never committed with another request's bytes
    assert w.counters["abandoned_blocks"] == 1 and w.counters["stored_blocks"] == 0


def test_preemption_waits_for_a_copy_in_progress_and_the_block_is_whole():
    made = []

    def gated(*args):
        made.append(GatedCopier(TorchPageCopier(*args)))
        return made[-1]

    w, cache, kv = _worker(copier_factory=gated)
    [copier] = made
    a = b"A" * 16
    want = _page_bytes(kv, [1, 2])
    _save(w, "r1", a, [1, 2])
    assert copier.started.wait(JOIN_S)  # the save is copying the request's pages
    t = _in_thread(w.handle_preemptions, UCMConnectorMetadata(preempted={"r1"}))
    t.join(0.2)
    assert t.is_alive(), "handle_preemptions returned while a copy still read the pages"
    copier.gate.set()
    t.join(JOIN_S)
    assert not t.is_alive()
    for n in NAMES:  # only now may vLLM reuse the pages
        kv[n][1:3] = 7
    w.shutdown()
    assert cache.blob(a) == want


def test_a_preempted_requests_load_reports_no_errors_for_pages_it_no_longer_owns():
    w, cache, kv = _worker()
    gate = cache.reserve_gate = threading.Event()
    a, b = b"A" * 16, b"B" * 16
    _save(w, "r1", a, [1, 2])
    before = {n: kv[n].clone() for n in NAMES}
    w.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("r2", [a, b], [[5, 6], [7, 8]], True)]))
    w.handle_preemptions(UCMConnectorMetadata(preempted={"r2"}))  # the load still waits for r1's save
    gate.set()
    w.shutdown()
    assert w.get_block_ids_with_load_errors() == set()
    assert w.counters["abandoned_blocks"] == 2
    for n in NAMES:
        assert torch.equal(kv[n][5:9], before[n][5:9])  # not written after the preemption


def test_a_step_whose_sync_load_failed_saves_nothing_of_that_request():
    """A synchronous load that misses a block leaves its pages as they were,
    and this step's forward computes the request's later blocks over them:
    those blocks must never be stored (a later hit would get that KV). The
    request is still reported in finished_sending, so vLLM frees its pages."""
    w, cache, kv = _worker()
    missing, later, other = b"M" * 16, b"L" * 16, b"O" * 16
    _step(w, loads=[LoadJob("r1", [missing], [[1, 2]], False)],
          stores=[StoreJob("r1", [later], [[3, 4]], missing), StoreJob("r2", [other], [[5, 6]], None)])
    assert w.get_block_ids_with_load_errors() == {1, 2}
    # A step whose sync load fails but that saves nothing of the request...
    _step(w, loads=[LoadJob("r1", [missing], [[1, 2]], False)])
    # ...and the next step is clean again: r1's recomputed block is saved then.
    _step(w, stores=[StoreJob("r1", [missing], [[1, 2]], None)])
    w.shutdown()
    assert later not in cache.slots and other in cache.slots and missing in cache.slots
    assert w.counters["tainted_blocks"] == 1
    assert w.get_finished({"r1", "r2"})[0] == {"r1", "r2"}
