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
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

import ucm.connectors.vllm as uv  # noqa: E402
from ucm.cache import Outcome  # noqa: E402

B, L, PPB = 10, 2, 2  # KV blocks, layers, pages per ucm block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
JOIN_S = 20.0


class CommitCache:
    """The slot API of CacheClient over a bytearray arena, with its
    reserve / fill / commit-or-abort contract: a `fill` that raises aborts
    its blocks (nothing is stored). `reserve_gate`, when set to an Event,
    holds write_slots before its fill (a slow reserve call) after setting
    `reserving`."""

    def __init__(self):
        self.arena = bytearray(1 << 20)
        self.slots, self.next = {}, 4096
        self.reserve_gate = None
        self.reserving = threading.Event()

    def write_slots(self, keys, sizes, fill, parent=None):
        self.reserving.set()
        if self.reserve_gate is not None:
            assert self.reserve_gate.wait(JOIN_S)
        slots = []
        for n in sizes:
            slots.append((self.next, n))
            self.next += n + 4096
        try:
            fill(0, slots, self.arena)
        except Exception:
            return [Outcome.FAILED] * len(keys)  # aborted: not committed
        for k, s in zip(keys, slots):
            self.slots[k] = s
        return [Outcome.DONE] * len(keys)

    def read_slots(self, keys, sizes, fill):
        slots = [self.slots.get(k) for k in keys]
        try:
            fill(0, slots, self.arena)
        except Exception:
            return [Outcome.FAILED] * len(keys)
        return [Outcome.DONE if s else Outcome.MISSING for s in slots]

    def blob(self, k):
        off, n = self.slots[k]
        return bytes(self.arena[off:off + n])


class GatedCopier:
    """Wraps the connector's page copier: each copy sets `started`, then
    waits for `gate` (a copy in progress, held open by the test)."""

    def __init__(self, inner):
        self.inner, self.started, self.gate = inner, threading.Event(), threading.Event()

    def copy(self, *args):
        self.started.set()
        assert self.gate.wait(JOIN_S)
        self.inner.copy(*args)

    def record_ready(self):
        return None

    def close(self):
        self.inner.close()


def _worker(**settings):
    conn = object.__new__(uv.UCMConnector)  # worker state only; no vLLM engine
    conn.settings = uv.ConnectorSettings(**settings)
    conn.pages_per_block = PPB
    conn._kv_cache_config = SimpleNamespace(num_blocks=B, kv_cache_tensors=[])
    conn._cache = CommitCache()
    conn._init_worker()
    kv = {n: torch.randn(B, 2, 16, 64).to(torch.bfloat16) for n in NAMES}
    conn.register_kv_caches(kv)
    return conn, kv


def _page_bytes(kv, pages):
    return b"".join(kv[n][p].contiguous().view(torch.uint8).numpy().tobytes() for n in NAMES for p in pages)


def _in_thread(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def _save(conn, req_id, key, pages):
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(stores=[uv.StoreJob(req_id, [key], [pages], None)]))
    conn.wait_for_save()
    conn.clear_connector_metadata()


def test_sync_load_does_not_wait_for_a_save_in_flight():
    conn, kv = _worker(load_timeout_s=3600.0)
    gate = conn._cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(conn, "r1", a, [1, 2])
    assert conn._cache.reserving.wait(JOIN_S)
    before = {n: kv[n].clone() for n in NAMES}
    t = _in_thread(conn._load, uv.LoadJob("r2", [a], [[5, 6]], False))
    t.join(JOIN_S)
    assert not t.is_alive(), "a synchronous load (in the forward) waited for a save"
    assert not gate.is_set()
    assert conn.get_block_ids_with_load_errors() == {5, 6}  # not there yet: vLLM recomputes it
    for n in NAMES:
        assert torch.equal(kv[n], before[n])
    gate.set()
    conn.shutdown()
    assert conn._cache.blob(a) == _page_bytes(kv, [1, 2])


def test_async_load_still_waits_for_the_save_it_follows():
    conn, kv = _worker()
    gate = conn._cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(conn, "r1", a, [1, 2])
    want = {n: kv[n][1:3].clone() for n in NAMES}
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(loads=[uv.LoadJob("r2", [a], [[5, 6]], True)]))
    conn.start_load_kv(None)
    assert conn.get_finished(set()) == (None, None)  # still waiting for the save
    gate.set()
    conn.shutdown()  # waits for the pool
    assert conn.get_finished(set()) == (None, {"r2"})
    assert conn.get_block_ids_with_load_errors() == set()
    for n in NAMES:
        assert torch.equal(kv[n][5:7], want[n])


def test_preemption_does_not_wait_for_a_save_that_has_not_copied_and_it_commits_nothing():
    conn, kv = _worker()
    gate = conn._cache.reserve_gate = threading.Event()
    a = b"A" * 16
    _save(conn, "r1", a, [1, 2])
    assert conn._cache.reserving.wait(JOIN_S)  # the save is in its (slow) reserve call
    t = _in_thread(conn.handle_preemptions, uv.UCMConnectorMetadata(preempted={"r1"}))
    t.join(JOIN_S)
    assert not t.is_alive(), "handle_preemptions waited for a save's I/O"
    for n in NAMES:  # vLLM gives the pages to another request, which writes them
        kv[n][1:3] = 7
    gate.set()
    conn.shutdown()
    assert a not in conn._cache.slots  # never committed with another request's bytes
    assert conn.counters["abandoned_blocks"] == 1 and conn.counters["stored_blocks"] == 0


def test_preemption_waits_for_a_copy_in_progress_and_the_block_is_whole():
    conn, kv = _worker()
    from ucm.connectors.torch_pages import TorchPageCopier

    storages = [torch.empty(0, dtype=torch.uint8).set_(kv[n].untyped_storage()) for n in NAMES]
    copier = conn._copier = GatedCopier(TorchPageCopier(storages, conn._layouts, PPB))
    a = b"A" * 16
    want = _page_bytes(kv, [1, 2])
    _save(conn, "r1", a, [1, 2])
    assert copier.started.wait(JOIN_S)  # the save is copying the request's pages
    t = _in_thread(conn.handle_preemptions, uv.UCMConnectorMetadata(preempted={"r1"}))
    t.join(0.2)
    assert t.is_alive(), "handle_preemptions returned while a copy still read the pages"
    copier.gate.set()
    t.join(JOIN_S)
    assert not t.is_alive()
    for n in NAMES:  # only now may vLLM reuse the pages
        kv[n][1:3] = 7
    conn.shutdown()
    assert conn._cache.blob(a) == want


def test_a_preempted_requests_load_reports_no_errors_for_pages_it_no_longer_owns():
    conn, kv = _worker()
    gate = conn._cache.reserve_gate = threading.Event()
    a, b = b"A" * 16, b"B" * 16
    _save(conn, "r1", a, [1, 2])
    before = {n: kv[n].clone() for n in NAMES}
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(loads=[uv.LoadJob("r2", [a, b], [[5, 6], [7, 8]],
                                                                           True)]))
    conn.start_load_kv(None)  # waits in the pool for r1's save
    conn.handle_preemptions(uv.UCMConnectorMetadata(preempted={"r2"}))
    gate.set()
    conn.shutdown()
    assert conn.get_block_ids_with_load_errors() == set()
    for n in NAMES:
        assert torch.equal(kv[n][5:9], before[n][5:9])  # not written after the preemption


def test_a_step_whose_sync_load_failed_saves_nothing_of_that_request():
    """A synchronous load that misses a block leaves its pages as they were,
    and this step's forward computes the request's later blocks over them:
    those blocks must never be stored (a later hit would get that KV). The
    request is still reported in finished_sending, so vLLM frees its pages."""
    conn, kv = _worker()
    missing, later, other = b"M" * 16, b"L" * 16, b"O" * 16
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(
        loads=[uv.LoadJob("r1", [missing], [[1, 2]], False)],
        stores=[uv.StoreJob("r1", [later], [[3, 4]], missing), uv.StoreJob("r2", [other], [[5, 6]], None)]))
    conn.start_load_kv(SimpleNamespace())
    assert conn.get_block_ids_with_load_errors() == {1, 2}
    conn.wait_for_save()
    conn.clear_connector_metadata()
    # A step whose sync load fails but that saves nothing of the request...
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(loads=[uv.LoadJob("r1", [missing], [[1, 2]], False)]))
    conn.start_load_kv(SimpleNamespace())
    conn.wait_for_save()
    conn.clear_connector_metadata()
    # ...and the next step is clean again: r1's recomputed block is saved then.
    conn.bind_connector_metadata(uv.UCMConnectorMetadata(stores=[uv.StoreJob("r1", [missing], [[1, 2]], None)]))
    conn.start_load_kv(SimpleNamespace())
    conn.wait_for_save()
    conn.clear_connector_metadata()
    conn.shutdown()
    assert later not in conn._cache.slots and other in conn._cache.slots and missing in conn._cache.slots
    assert conn.counters["tainted_blocks"] == 1
    assert conn.get_finished({"r1", "r2"})[0] == {"r1", "r2"}
