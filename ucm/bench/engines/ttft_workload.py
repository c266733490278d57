"""The workload of the time-to-first-token benches (`ucm bench vllm`,
`transformers`, `prefetch`): documents of deterministic pseudo-random token
ids, each asked twice with two questions, so that the second ask can reuse
the document's full blocks; and the length of the greedy continuation that
checks a hit's output beyond its first token.

The ids are drawn from the tokenizer's ordinary vocabulary (special tokens
left out) with a fixed seed, so every engine and every run sees the same
prompts. Pure Python over token ids; runs in the caller's thread.
"""
from __future__ import annotations

import random
from typing import Any

CHECK_TOKENS = 8  # the greedy continuation compared after the timings
QUESTIONS = ("\n\nQuestion: What is the main topic of the document above? Answer briefly.\nAnswer:",
             "\n\nQuestion: Which three names appear most often in the document above? List them.\nAnswer:")
WARM_TOKENS = 200


def vocabulary(tok: Any) -> list[int]:
    """The ids prompts are drawn from: 1000 up to 40000 (or the vocabulary's
    end), special tokens left out."""
    special = set(tok.all_special_ids)
    return [i for i in range(1000, min(tok.vocab_size, 40000)) if i not in special]


def documents(tok: Any, docs: int, doc_tokens: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(pass 1: each document and the first question, pass 2: each document
    and the second, a short warm-up prompt drawn after them)."""
    vocab = vocabulary(tok)
    rng = random.Random(1234)
    q1, q2 = (tok.encode(q, add_special_tokens=False) for q in QUESTIONS)
    texts = [[rng.choice(vocab) for _ in range(doc_tokens)] for _ in range(docs)]
    warm = [rng.choice(vocab) for _ in range(WARM_TOKENS)]
    return [d + q1 for d in texts], [d + q2 for d in texts], warm
