"""Which tokens a blend recomputes, whatever the engine
(ucm/connectors/blend_select.py): the budget, anchors, and the layers whose
attention the `question` selection counts."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ucm.accelerators.blend import BlendOptions  # noqa: E402
from ucm.connectors.blend_select import checked_layers, question_layers, select  # noqa: E402


def test_question_counts_the_last_half_of_the_layers_unless_told():
    assert question_layers(BlendOptions(select="question"), 30) == range(15, 30)
    assert question_layers(BlendOptions(select="question"), 3) == range(1, 3)
    assert question_layers(BlendOptions(select="question", question_from_layer=4), 30) == range(4, 30)
    assert question_layers(BlendOptions(select="question", question_from_layer=0), 30) == range(0, 30)
    assert question_layers(BlendOptions(select="question", question_from_layer=99), 30) == range(29, 30)


def test_question_computes_no_layer_for_every_token_and_takes_the_ratio_of_the_reused():
    n = 40
    reused = torch.ones(n, dtype=torch.bool)
    reused[20:22] = False  # text between two chunks
    exact = torch.zeros(n, dtype=torch.bool)
    exact[:8] = True  # the system prompt
    options = BlendOptions(select="question", ratio=0.25, anchor_tokens=2)
    assert checked_layers(options, 30) == 0
    plan = select(options, reused, exact, [(8, 20), (22, 40)], n)
    assert plan.budget == 8 - 4  # ceil(0.25 * 30 reused tokens after the system prompt), less 2 anchors each
    assert plan.chosen.nonzero().flatten().tolist() == [8, 9, 20, 21, 22, 23]
    score = torch.arange(n, dtype=torch.float32)  # the latest positions read most
    pos = torch.arange(n)
    chosen = plan.add_top(score, pos).nonzero().flatten().tolist()
    assert chosen == [8, 9, 20, 21, 22, 23, 36, 37, 38, 39]


def test_question_mass_is_the_causal_softmax_of_each_query_head_over_its_kv_head():
    from ucm.connectors.blend_select import question_mass

    torch.manual_seed(0)
    n, q, heads, kv_heads, d = 11, 3, 6, 2, 8
    query, keys = torch.randn(q, heads, d), torch.randn(n + q, kv_heads, d)
    want = torch.zeros(n)
    for i in range(q):  # question token i sits at n + i and reads keys 0..n+i
        for h in range(heads):
            k = keys[:n + i + 1, h // (heads // kv_heads)]
            want += torch.softmax(k @ query[i, h] * 0.5, dim=0)[:n]
    got = question_mass(query, keys, 0.5, n)
    assert torch.allclose(got, want, atol=1e-5)
    assert got.sum() < q * heads  # the question's own keys take the rest
