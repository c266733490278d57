"""The RAG workload of `ucm bench blend` (ucm/bench/engines/blend_tasks.py)
over a character tokenizer, and the bench's per-method row."""
from __future__ import annotations

import pytest

from ucm.bench.engines.blend_bench import _methods
from ucm.bench.engines.blend_report import row as _row, table
from ucm.bench.engines.blend_tasks import NAMES, WORDS, rag_prompts
from ucm.errors import ArgumentError


class _Chars:
    """One token per character (its code point)."""

    class _Out:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Out([ord(c) for c in text])


def _text(ids):
    return "".join(map(chr, ids))


def _prompts(**kw):
    args = dict(prompts=12, k=4, pool=6, passage_tokens=300, seed=3, document="stdlib")
    args.update(kw)
    return rag_prompts(_Chars(), **args)[1]


def test_prompts_are_seeded_and_share_passages_at_different_positions():
    a, b, c = _prompts(), _prompts(), _prompts(seed=4)
    assert [p.ids for p in a] == [p.ids for p in b]
    assert [p.ids for p in a] != [p.ids for p in c]
    seen: dict[int, tuple[list[int], set[int]]] = {}
    for p in a:
        assert len(p.spans) == len(p.passages) == 4
        assert p.spans[0][0] == p.system_tokens
        for (s, e), idx in zip(p.spans, p.passages):
            assert e - s == 300
            body, starts = seen.setdefault(idx, (p.ids[s:e], set()))
            assert p.ids[s:e] == body  # the same passage, token for token, wherever it sits
            starts.add(s)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(p.spans, p.spans[1:]))
    assert any(len(starts) > 1 for _, starts in seen.values())  # some passage moved between prompts


def test_no_two_passages_share_text():
    # distinct passages of a corpus share no run of text (a few boilerplate lines at most, under 256 characters)
    text = {}
    for p in _prompts(prompts=30, k=6, pool=32, passage_tokens=12000, document="essays"):  # 384K of 700K chars
        for (s, e), idx in zip(p.spans, p.passages):
            text[idx] = p.ids[s:e]
    grams = {i: {tuple(t[j:j + 256]) for j in range(len(t) - 256)} for i, t in text.items()}
    assert len(grams) > 20
    assert all(not grams[a] & grams[b] for a in grams for b in grams if a < b)


def test_every_answer_is_in_the_prompts_passages():
    for p in _prompts(two_hop_share=0.5):
        passages = [_text(p.ids[s:e]) for s, e in p.spans]
        question = _text(p.ids[p.spans[-1][1]:])
        holder = [t for t in passages if f"pass key is {p.key}" in t]
        assert len(holder) == 1
        if p.kind == "two_hop":
            word = next(w for w in WORDS if f"The {w} door" in question)
            keeper = next(t for t in passages if f"The {word} door is kept by" in t)
            name = keeper.split(f"The {word} door is kept by ")[1].split(".")[0]
            assert f"{name}'s pass key is {p.key}" in holder[0]
        else:
            name = next(n for n in NAMES if f"What is {n}'s" in question)
            assert f"{name}'s pass key is {p.key}" in holder[0]
        assert p.correct(f" {p.key[:2]} {p.key[2:]}.") and not p.correct("12")


def test_bad_workloads_are_typed_errors():
    with pytest.raises(ArgumentError, match="pool"):
        _prompts(k=8, pool=6)
    with pytest.raises(ArgumentError, match="passage_tokens"):
        _prompts(passage_tokens=10)


def test_a_row_summarizes_a_method():
    d = {"ttft": [0.4, 0.1, 0.2, 0.3], "kl": [0.1, 0.3], "agree": [1.0, 0.5], "needle": [True, False, True],
         "two_hop": [], "work": [0.2, 0.4], "reads": [{"dram": 2, "nvme": 1}, {"dram": 4, "nvme": 0}]}
    row = _row({"method": "blend", "source": "ucm", "ratio": 0.15, "select": "question"}, d, block_bytes=1000)
    assert row["ttft_p50_s"] == pytest.approx(0.25) and row["ttft_p90_s"] == 0.4
    assert row["kl"] == pytest.approx(0.2) and row["greedy_agreement"] == 0.75
    assert row["needle_accuracy"] == pytest.approx(2 / 3) and row["two_hop_accuracy"] is None
    assert row["recompute_share"] == pytest.approx(0.3)
    assert row["kv_read_bytes"] == {"dram": 3000, "nvme": 500}  # per request
    assert row["label"] == "blend 15% question" and row["context"] == "prefix" and row["select"] == "question"
    alone = _row({"method": "naive", "source": "ucm", "ratio": 0.0, "context": "none"}, d, block_bytes=1000)
    assert alone["label"] == "naive (alone)" and alone["context"] == "none"
    full = _row({"method": "full", "source": None, "ratio": None}, dict(d, kl=[0, 0]), block_bytes=1000)
    text = table({"machine": "m", "workload": {"prompts": 4, "k": 6, "passage_tokens": 512}, "source": "s",
                  "dtype": "float32", "rows": [full, row], "plot": "p.png"})
    assert "blend 15% question" in text and "blend 15% question 1.00x" in text


def test_methods_compare_chunks_alone_and_cacheblends_deviation_at_the_ratio_nearest_15_percent():
    methods = _methods([0.05, 0.1, 0.2, 0.3], 16)
    alone = [m for m in methods if m.get("context") == "none"]
    assert [(m["method"], m["ratio"], m.get("select")) for m in alone] == [("naive", 0.0, None),
                                                                           ("blend", 0.1, "question")]
    together = [(m["ratio"], m["select"]) for m in methods if m["method"] == "blend" and "context" not in m]
    assert together == [(0.05, "question"), (0.1, "question"), (0.2, "question"), (0.3, "question"),
                        (0.1, "deviation")]
    assert not [m for m in _methods([], 16) if m["method"] == "blend"]


def test_the_vllm_rows_are_the_methods_that_path_has():
    from ucm.bench.engines.blend_vllm import methods

    got = [(m["method"], m.get("source"), m["ratio"], m.get("select")) for m in methods([0.15, 0.3], 16)]
    assert got == [("full", None, None, None), ("prefix", "engine", None, None), ("naive", "ucm", 0.0, None),
                   ("blend", "ucm", 0.15, "question"), ("blend", "ucm", 0.3, "question"),
                   ("blend", "ucm", 0.15, "deviation"), ("leading", "ucm", None, None)]


def test_the_vllm_kl_over_the_full_prefills_top_tokens_is_exact_when_they_hold_all_and_a_lower_bound_else():
    import torch

    from ucm.bench.engines.blend_vllm import _kl

    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(5, 64, generator=g) * 3, -1)
    q = torch.log_softmax(torch.randn(5, 64, generator=g) * 3, -1)
    exact = float((p.exp() * (p - q)).sum(-1).mean())
    assert _kl(p, q, p.topk(64, dim=-1).indices) == pytest.approx(exact, rel=1e-5)
    assert 0 < _kl(p, q, p.topk(16, dim=-1).indices) <= exact + 1e-6
    assert _kl(p, p, p.topk(16, dim=-1).indices) == pytest.approx(0.0, abs=1e-6)
