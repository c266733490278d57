"""The demo's workload, sizing and report, without an engine (the whole
demo end to end: tests/e2e/test_demo.py)."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from ucm.apps.demo.run import service_config
from ucm.apps.model import page_bytes
from ucm.apps.demo.report import machine_line, summarize, table
from ucm.apps.demo.workload import (CHAT_FIRST, CHAT_NEXT, DOC_AGAIN, DOC_FIRST, QUICK, WorkloadSpec,
                                    build_workload, distinct_blocks)
from ucm.config.schema import load_config

ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """A chat-template tokenizer stand-in: one id per word, fixed markers per
    message, deterministic across processes."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        ids = []
        for m in messages:
            ids += [1, {"system": 2, "user": 3, "assistant": 4}[m["role"]]]
            ids += [10 + sum(map(ord, w)) % 5000 for w in m["content"].split()]
            ids.append(5)
        return ids + ([1, 4] if add_generation_prompt else [])


def test_the_workload_is_seeded_and_has_every_class_in_the_right_numbers():
    spec = WorkloadSpec(docs=3, asks=3, doc_words=80, chats=2, turns=4, reply_words=20, system_repeat=1)
    a, b = build_workload(WordTokenizer(), spec), build_workload(WordTokenizer(), spec)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    other = build_workload(WordTokenizer(), dataclasses.replace(spec, seed=20))
    assert [r.prompt for r in other] != [r.prompt for r in a]
    assert Counter(r.cls for r in a) == {DOC_FIRST: 3, DOC_AGAIN: 6, CHAT_FIRST: 2, CHAT_NEXT: 6}
    assert [r.index for r in a] == list(range(len(a)))


def test_sessions_are_interleaved_in_order_and_reuse_their_prefixes():
    reqs = build_workload(WordTokenizer(), WorkloadSpec(docs=3, asks=3, doc_words=80, chats=3, turns=4,
                                                        reply_words=20, system_repeat=1))
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    for session, rs in by_session.items():
        assert [r.step for r in rs] == list(range(1, len(rs) + 1))
        if session.startswith("chat"):  # each turn's prompt extends the previous turn's
            assert all(b.prompt[:len(a.prompt)] == a.prompt for a, b in zip(rs, rs[1:]))
        else:  # the asks share the system prompt and the document, not the question
            common = min(len(r.prompt) for r in rs) - 40
            assert all(r.prompt[:common] == rs[0].prompt[:common] for r in rs)
            assert len({tuple(r.prompt) for r in rs}) == len(rs)
    # never the same session twice in a row while another one has requests left
    for i in range(1, len(reqs)):
        if reqs[i].session == reqs[i - 1].session:
            assert all(r.session == reqs[i].session for r in reqs[i:])
    # the two applications have their own shared system prompts
    docs = [r for r in reqs if r.session.startswith("doc")]
    chats = [r for r in reqs if r.session.startswith("chat")]
    assert docs[0].prompt[:20] == docs[-1].prompt[:20] != chats[0].prompt[:20] == chats[-1].prompt[:20]


def test_distinct_blocks_counts_full_blocks_of_distinct_prefixes():
    from ucm.apps.demo.workload import DemoRequest

    reqs = [DemoRequest(0, "a", DOC_FIRST, 1, [1] * 10), DemoRequest(1, "a", DOC_AGAIN, 2, [1] * 9 + [2]),
            DemoRequest(2, "b", CHAT_FIRST, 1, [1] * 4 + [3] * 7)]
    # blocks of 4: [1111],[1111] shared by all; [11 11 | 2 ...] no third full block in 0/1; [3333] in 2
    assert distinct_blocks(reqs, 4) == 3


def test_a_bad_workload_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec(turns=0)
    assert QUICK.docs < WorkloadSpec().docs


def test_page_bytes_follow_the_model_geometry(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}))
    assert page_bytes(tmp_path, "float32", 128) == 5_898_240  # 30 x (K, V) x 3 heads x 64 x 4 B x 128 tokens
    assert page_bytes(tmp_path, "bfloat16", 128) == 2_949_120


def test_the_service_config_is_valid_and_holds_exactly_its_dram_blocks(tmp_path):
    block = 5_898_240
    cfg = load_config(service_config(ROOT / "configs" / "default.yaml", tmp_path, 9, block, 1 << 30),
                      environ={})
    dram = next(t for t in cfg.tiers if t.adapter == "dram")
    nvme = next(t for t in cfg.tiers if t.adapter == "nvme")
    assert cfg.block_tokens == 128 and dram.capacity == 9 * block and nvme.capacity == 1 << 30
    assert str(tmp_path) in str(cfg.service.socket)
    assert cfg.events.path == str(tmp_path / "catalog.log")  # not default.yaml's shared file


def _rows(ttfts, tokens, engine=0, ucm=0):
    return [{"index": i, "prompt_tokens": 300, "ttft_s": t, "engine_tokens": engine, "ucm_tokens": ucm,
             "ucm_dram_tokens": ucm, "ucm_nvme_tokens": 0, "tokens": tok} for i, (t, tok) in
            enumerate(zip(ttfts, tokens))]


def test_the_summary_counts_equal_outputs_percentiles_and_tokens_by_source():
    classes = {0: DOC_FIRST, 1: DOC_AGAIN, 2: DOC_AGAIN}
    runs = [{"name": "vLLM alone", "rows": _rows([1.0, 2.0, 3.0], [[1], [2], [3]], engine=100)},
            {"name": "vLLM + ucm", "rows": _rows([1.0, 0.2, 0.4], [[1], [2], [9]], engine=100, ucm=128)}]
    s = summarize(runs, classes)
    alone, ucm = s["runs"]
    assert alone["ttft_s"][DOC_AGAIN]["p50"] == pytest.approx(2.5)
    assert alone["ttft_s"]["all"]["p90"] == pytest.approx(2.8)
    assert ucm["equal"] == 2 and ucm["unequal"] == [2]
    assert ucm["tokens"] == {"engine_tokens": 300, "ucm_dram_tokens": 384, "ucm_nvme_tokens": 0,
                             "computed_tokens": 900 - 300 - 384}
    text = table(s)
    assert "2/3" in text and "(reference)" in text and CHAT_FIRST not in text


def test_the_machine_line_reads_proc(tmp_path):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Test CPU  9000\nflags\t\t: fpu avx2\n")
    (tmp_path / "meminfo").write_text("MemTotal:        2097152 kB\n")
    line = machine_line(str(tmp_path))
    assert line.startswith("Test CPU 9000, ") and "(AVX2, no AVX-512), 2.0 GiB RAM, no GPU" in line
    (tmp_path / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert machine_line(str(tmp_path)).endswith("1 NVIDIA GPU(s)")


def test_the_nvme_share_of_a_hit_counts_a_partial_last_block_by_its_tokens():
    from ucm.apps.demo.engine import BLOCK_TOKENS as B, nvme_share

    # a DRAM block then a partial NVMe block (100 of its tokens served)
    assert nvme_share(0, B + 100, ["dram", "nvme"]) == 100
    # an NVMe block then a partial DRAM block: only the full block is NVMe
    assert nvme_share(0, B + 100, ["nvme", "dram"]) == B
    # vLLM's own blocks first; a block still being saved (None) counts as DRAM
    assert nvme_share(B, 2 * B, ["nvme", "nvme", None]) == B
    assert nvme_share(0, 0, ["nvme"]) == 0
