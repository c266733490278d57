"""Sparse decode's engine-free pieces (ucm/connectors/vllm/sparse_pages.py)
on synthetic paged KV laid out as vLLM's CPU backend lays it out, with a
shuffled block table: page summaries equal the min / max / mean of the
logical keys and follow vLLM's writes, gathering reads the tokens of the
logical sequence, and attention over gathered tokens equals a reference
softmax over the same tokens of the unpaged K/V."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig  # noqa: E402
from ucm.accelerators.sparse.selectors import make_selector  # noqa: E402
from ucm.accelerators.sparse.summaries import store_bounds  # noqa: E402
from ucm.connectors.vllm.sparse_pages import (HeldSelections, PageSummaries, attend, context_keys,  # noqa: E402
                                              gather_tokens, range_positions)
from ucm.errors import ArgumentError  # noqa: E402

BT, PT, H, D, QH = 128, 16, 3, 64, 9  # block tokens, page tokens, KV heads, head size, query heads


def _paged(n, num_blocks=12, seed=0):
    """(kv_cache [num_blocks, H, BT, 2D] as the CPU backend holds it, its
    key/value views, the block row, the logical K and V [n, H, D])."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=g)
    v = torch.randn(n, H, D, generator=g)
    row = torch.randperm(num_blocks, generator=g)[:math.ceil(n / BT)]
    kv = torch.full((num_blocks, H, BT, 2 * D), float("nan"))
    key_cache, value_cache = kv.view(num_blocks, H, 2 * BT, D).chunk(2, dim=2)
    for t in range(n):
        key_cache[row[t // BT], :, t % BT] = k[t]
        value_cache[row[t // BT], :, t % BT] = v[t]
    return kv, key_cache, value_cache, row, k, v


def _reference(q, k, v, positions, scale):
    """Plain softmax attention of q [QH, D] over k/v [n, H, D] at `positions`, GQA, float64."""
    q, k, v = q.double(), k[positions].double(), v[positions].double()
    out = torch.empty(QH, D, dtype=torch.float64)
    for h in range(QH):
        kv_head = h // (QH // H)
        w = torch.softmax(k[:, kv_head] @ q[h] * scale, dim=0)
        out[h] = w @ v[:, kv_head]
    return out


def test_summaries_equal_the_pages_of_the_logical_keys():
    n = 300
    _, key_cache, _, row, k, _ = _paged(n)
    s = PageSummaries(12, H, BT, D, PT, keep_mean=True)
    u = s.units(key_cache, row, n)
    assert u.units == n // PT and u.unit_tokens == PT
    pages = k[:u.units * PT].reshape(u.units, PT, H, D)
    low, high = store_bounds(pages.amin(dim=1).numpy(), pages.amax(dim=1).numpy())  # float16, outwards
    np.testing.assert_array_equal(u.min, low.astype(np.float32))
    np.testing.assert_array_equal(u.max, high.astype(np.float32))
    assert s.min.dtype == s.max.dtype == torch.float16 and u.min.dtype == np.float32
    np.testing.assert_allclose(u.mean, pages.mean(dim=1).numpy(), rtol=1e-6, atol=1e-6)
    assert s.pages_summarized == u.units
    s.units(key_cache, row, n)  # nothing written since: nothing summarised again
    assert s.pages_summarized == u.units


def test_a_written_page_is_summarised_again_and_only_it():
    n = 256
    _, key_cache, _, row, _, _ = _paged(n)
    s = PageSummaries(12, H, BT, D, PT)
    s.units(key_cache, row, n)
    before = s.pages_summarized
    t = 130  # block 1 of the row, page 0 of it
    key_cache[row[1], :, 2] = 100.0
    s.mark_written(torch.tensor([-1, int(row[1]) * BT + 2]))  # -1: padding, ignored
    u = s.units(key_cache, row, n)
    assert s.pages_summarized == before + 1
    assert float(u.max[t // PT].max()) == 100.0
    # a block written behind the layer's back (a connector load) is marked by the caller
    key_cache[row[0], :, 0] = -100.0
    s.mark_blocks(row[:1])
    u = s.units(key_cache, row, n)
    assert float(u.min[0].min()) == -100.0 and s.pages_summarized == before + 1 + BT // PT


def test_with_a_basis_the_projections_are_the_logical_keys_projected_and_follow_the_writes():
    from ucm.accelerators.sparse.lowrank import fit_key_basis

    n = 300
    _, key_cache, _, row, k, _ = _paged(n)
    s = PageSummaries(12, H, BT, D, PT)
    assert s.units(key_cache, row, n).proj is None  # no basis yet
    basis = fit_key_basis([k.transpose(0, 1).numpy()], 4).vectors[0]
    before = s.pages_summarized
    s.set_basis(basis)
    u = s.units(key_cache, row, n)
    assert s.pages_summarized == before + n // PT  # every page again, now with its projections
    want = np.einsum("thd,hdr->htr", k[:n // PT * PT].numpy(), basis)
    np.testing.assert_allclose(u.proj, want, rtol=2.0 ** -10, atol=1e-5)  # kept as float16
    assert u.basis is s.basis and u.proj.shape == (H, n // PT * PT, 4)
    key_cache[row[1], :, 5] = 3.0  # token 133
    s.mark_written(torch.tensor([int(row[1]) * BT + 5]))
    u = s.units(key_cache, row, n)
    np.testing.assert_allclose(u.proj[:, 133], np.einsum("hd,hdr->hr", np.full((H, D), 3.0), basis), rtol=2.0 ** -10)
    with pytest.raises(ArgumentError, match=r"basis \(2, 64, 4\) is not \[3, 64, rank\]"):
        s.set_basis(basis[:2])
    assert s.proj.dtype == torch.float16  # kept as the transformers path keeps them


def test_summaries_keep_only_what_the_selector_reads():
    n = 300
    _, key_cache, _, row, k, _ = _paged(n)
    lowrank = PageSummaries(12, H, BT, D, PT, keep_bounds=False)  # lowrank's: projections only
    assert lowrank.min is None and lowrank.max is None and lowrank.mean is None
    from ucm.accelerators.sparse.lowrank import fit_key_basis

    lowrank.set_basis(fit_key_basis([k.transpose(0, 1).numpy()], 4).vectors[0])
    u = lowrank.units(key_cache, row, n)
    assert u.min is None and u.max is None and u.mean is None and u.units == n // PT and u.proj.shape[1] == u.units * PT
    with pytest.raises(ArgumentError, match="selector 'quest' needs summaries that keep the key bounds"):
        make_selector("quest").select(LayerStep(np.ones((QH, D), np.float32), n, PT, H, summaries=u),
                                      SelectionConfig(Budget.tokens(32), 16, 16))
    mean = PageSummaries(12, H, BT, D, PT, keep_bounds=False, keep_mean=True)  # `mean`'s
    u = mean.units(key_cache, row, n)
    assert u.min is None and u.proj is None
    want = k[:n // PT * PT].reshape(-1, PT, H, D).mean(dim=1).numpy()  # [pages, H, D]
    np.testing.assert_allclose(u.mean, want, rtol=1e-5, atol=1e-6)


def test_gathered_tokens_are_the_sequence_tokens():
    n = 400
    _, key_cache, value_cache, row, k, v = _paged(n, seed=1)
    pos = range_positions([(0, 16), (100, 140), (390, 400)])
    assert pos.tolist() == list(range(16)) + list(range(100, 140)) + list(range(390, 400))
    assert torch.equal(gather_tokens(key_cache, row, pos), k[pos])
    assert torch.equal(gather_tokens(value_cache, row, pos), v[pos])
    np.testing.assert_array_equal(context_keys(key_cache, row, n), k.transpose(0, 1).numpy())


@pytest.mark.parametrize("ranges", [[(0, 400)], [(0, 32), (200, 216), (300, 400)], [(399, 400)]])
def test_attention_over_gathered_tokens_equals_the_reference(ranges):
    n, scale = 400, 1 / math.sqrt(D)
    _, key_cache, value_cache, row, k, v = _paged(n, seed=2)
    q = torch.randn(QH, D, generator=torch.Generator().manual_seed(3))
    pos = range_positions(ranges)
    got = attend(q, gather_tokens(key_cache, row, pos), gather_tokens(value_cache, row, pos), scale)
    torch.testing.assert_close(got.double(), _reference(q, k, v, pos, scale), rtol=1e-5, atol=1e-5)


def test_quest_over_paged_summaries_picks_the_page_that_holds_the_match():
    """A query aligned with the keys of one page far from sink and local:
    quest, scoring the paged summaries, picks that page first."""
    n, scale = 700, 1 / math.sqrt(D)
    _, key_cache, value_cache, row, k, v = _paged(n, seed=4)
    q = torch.zeros(QH, D)
    target = 20  # tokens 320..336
    for h in range(QH):
        q[h] = 4 * k[target * PT + 5, h // (QH // H)]
    s = PageSummaries(12, H, BT, D, PT)
    step = LayerStep(q.numpy(), n, PT, H, summaries=s.units(key_cache, row, n), scale=scale)
    sel = make_selector("quest").select(step, SelectionConfig(Budget.tokens(PT), sink_tokens=64, local_tokens=128))
    assert sel.units == (target,)
    # the local window widens to the page it starts in (560..576 touches 572..700)
    assert sel.ranges == ((0, 64), (target * PT, (target + 1) * PT), (560, n))


def test_bad_page_size_is_refused():
    with pytest.raises(ArgumentError, match="page_tokens 24 must divide block_tokens 128"):
        PageSummaries(4, H, BT, D, 24)


def _held_at(every, n0=700, seed=0):
    """A HeldSelections holding one selection made at `n0` tokens (forward 1)."""
    kv, kc, vc, row, k, v = _paged(n0 + 8, seed=seed)
    s = PageSummaries(12, H, BT, D, PT)
    s.units(kc, row, n0)
    held = HeldSelections(every, BT, PT)
    held.tick()
    picked = torch.cat([torch.arange(0, 64), torch.arange(320, 336), torch.arange(n0 - 128, n0)])
    held.keep(s, row, n0, picked)
    return held, s, row, picked


def test_a_held_selection_is_reused_for_every_steps_with_the_new_tokens():
    held, s, row, picked = _held_at(3)
    assert len(held) == 1
    held.tick()  # forward 2: one token decoded
    assert torch.equal(held.find(s, row, 701), torch.cat([picked, torch.tensor([700])]))
    s.mark_written(row[700 // BT] * BT + torch.tensor([701 % BT]))  # the next token's write: a page past n0
    held.tick()  # forward 3
    assert torch.equal(held.find(s, row, 702), torch.cat([picked, torch.tensor([700, 701])]))
    held.tick()  # forward 4: made 3 forwards ago, expired
    assert held.find(s, row, 703) is None and len(held) == 0


def test_a_held_selection_is_dropped_when_its_pages_or_blocks_change():
    held, s, row, _ = _held_at(4)
    held.tick()
    s.mark_written(row[2] * BT + torch.tensor([5]))  # token 261 of the context rewritten
    assert held.find(s, row, 701) is None
    held, s, row, _ = _held_at(4)
    held.tick()
    s.mark_written(row[696 // BT] * BT + torch.tensor([696 % BT]))  # the partial last page: not held, re-read
    assert held.find(s, row, 701) is not None
    s.mark_blocks(row[:1])  # a prefill over the row's first block (a prefix hit of another row)
    assert held.find(s, row, 701) is None
    held, s, row, _ = _held_at(4)
    held.tick()
    other = row.clone()
    other[1] = 11 if int(row[1]) != 11 else 10  # the same last block, another block in between
    assert held.find(s, other, 701) is None
    assert held.find(s, row, 701) is not None


def test_every_one_holds_nothing_and_a_bad_every_is_refused():
    held, s, row, _ = _held_at(1)
    assert len(held) == 0
    held.tick()
    assert held.find(s, row, 701) is None
    with pytest.raises(ArgumentError, match="every must be an int >= 1"):
        HeldSelections(0, BT, PT)
