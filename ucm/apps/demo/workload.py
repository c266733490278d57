"""The demo's workload: several users of one vLLM engine, interleaved.

Two applications share the engine, each with its own system prompt:
- document Q&A: `docs` documents, each asked about `asks` times (the user
  message is the document followed by a question; the later asks reuse the
  system prompt and the document, and differ in the question);
- chat: `chats` conversations of `turns` turns; every turn's prompt is the
  whole history so far plus the new user message, so each turn reuses the
  previous turn's prompt. The assistant replies in the history are scripted
  (they do not depend on what a run generated), so every run sees exactly
  the same prompts.

Requests of all sessions are interleaved in a seeded random order (each
session's own requests in order, never the same session twice in a row),
as requests of many users reach one engine; a document's later asks and a
chat's next turn therefore come back after other users' work, by which
time an engine whose KV space holds a few prompts has evicted them.

Text is seeded pseudo-English (the model only has to read it), rendered
with the model's chat template by the tokenizer given; the result is token
ids, so every engine process replays identical prompts. Pure Python, no
engine: the tokenizer is passed in.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

# Request classes, in the order the report lists them.
DOC_FIRST = "doc, first ask"
DOC_AGAIN = "doc, asked again"
CHAT_FIRST = "chat, first turn"
CHAT_NEXT = "chat, next turn"
CLASSES = (DOC_FIRST, DOC_AGAIN, CHAT_FIRST, CHAT_NEXT)

_WORDS = (
    "system network memory cache request model engine token layer block storage disk page query answer "
    "document report table figure result method value number order policy user service latency budget "
    "program record message history question summary section chapter process plan design review test "
    "river mountain city market garden school library museum harbor bridge station forest valley island "
    "water light energy signal pattern region border season weather journey letter picture story music "
    "small large early late quick slow careful simple complex local remote shared private hot cold new "
    "old first last main final public useful common rare stable recent long short clear open full empty "
    "reads writes keeps moves builds checks finds sends holds shows takes gives makes uses needs starts "
    "stops grows counts loads stores serves returns follows explains describes compares measures records"
).split()
_QUESTIONS = (
    "What is the main point of this document?", "Which numbers does the document report, and what do they measure?",
    "Summarise the second section in two sentences.", "What does the document say about the storage budget?",
    "List the open questions the document leaves.", "Who would find this document useful, and why?",
)
_TOPICS = ("planning a trip through the mountains", "keeping a small garden through the winter",
           "learning to read music", "running a neighbourhood library", "building a model bridge",
           "cooking for a large family", "training for a long race", "repairing an old bicycle")
SYSTEM_DOCS = ("You are a careful assistant for a team's internal documents. Answer only from the document the "
               "user gives, quote the relevant sentence when you can, and say so when the document does not "
               "contain the answer. Keep answers short: one or two sentences unless the user asks for more. ")
SYSTEM_CHAT = ("You are a friendly, patient tutor. Explain things step by step with everyday examples, check "
               "what the learner already knows before going deeper, and end every answer with one short "
               "question that invites the learner to continue. Avoid jargon unless you define it. ")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The size of the workload (tokens are approximate: text is sized in
    words and then tokenized)."""

    docs: int = 4
    asks: int = 3  # asks per document
    doc_words: int = 1000
    chats: int = 3
    turns: int = 6
    reply_words: int = 110  # scripted assistant reply per turn
    system_repeat: int = 3  # each system prompt is its paragraph this many times (a long shared prefix)
    seed: int = 19

    def __post_init__(self) -> None:
        for name in ("docs", "asks", "doc_words", "chats", "turns", "reply_words", "system_repeat"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"workload {name} must be an int >= 1, got {v!r}")


QUICK = WorkloadSpec(docs=2, asks=2, doc_words=260, chats=2, turns=3, reply_words=60, system_repeat=1, seed=19)


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request of the workload: `index` in arrival order, its session
    (`doc2`, `chat1`), its class (one of CLASSES), its ordinal within the
    session (ask or turn, from 1), and the prompt's token ids."""

    index: int
    session: str
    cls: str
    step: int
    prompt: list[int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sentences(rng: random.Random, words: int) -> str:
    out, n = [], 0
    while n < words:
        k = rng.randint(8, 18)
        s = " ".join(rng.choice(_WORDS) for _ in range(k))
        out.append(s[0].upper() + s[1:] + ".")
        n += k
    return " ".join(out)


def _ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _interleave(rng: random.Random, sessions: dict[str, int]) -> list[tuple[str, int]]:
    """(session, step) in a random order that keeps each session's steps in
    order and never serves one session twice in a row (unless it is the only
    one left)."""
    left = dict(sessions)
    done = {s: 0 for s in sessions}
    order: list[tuple[str, int]] = []
    last = None
    while left:
        pool = [s for s in left if s != last] or list(left)
        s = rng.choice(pool)
        done[s] += 1
        order.append((s, done[s]))
        left[s] -= 1
        if left[s] == 0:
            del left[s]
        last = s
    return order


def build_workload(tokenizer: Any, spec: WorkloadSpec = WorkloadSpec()) -> list[DemoRequest]:
    """The requests of `spec`, in arrival order, as token ids rendered by
    `tokenizer` (a Hugging Face tokenizer with a chat template)."""
    rng = random.Random(spec.seed)
    sys_docs = {"role": "system", "content": SYSTEM_DOCS * spec.system_repeat}
    sys_chat = {"role": "system", "content": SYSTEM_CHAT * spec.system_repeat}
    documents = [_sentences(rng, spec.doc_words) for _ in range(spec.docs)]
    convs = []
    for c in range(spec.chats):
        topic = _TOPICS[c % len(_TOPICS)]
        turns = []
        for t in range(spec.turns):
            user = (f"I am {topic}. Step {t + 1}: " + _sentences(rng, rng.randint(25, 45)) +
                    " What should I do next, and why?")
            turns.append((user, _sentences(rng, spec.reply_words)))
        convs.append(turns)
    sessions = {f"doc{d + 1}": spec.asks for d in range(spec.docs)}
    sessions.update({f"chat{c + 1}": spec.turns for c in range(spec.chats)})
    out: list[DemoRequest] = []
    for i, (session, step) in enumerate(_interleave(rng, sessions)):
        n = int(session.removeprefix("doc").removeprefix("chat")) - 1
        if session.startswith("doc"):
            q = _QUESTIONS[(n + step - 1) % len(_QUESTIONS)]
            msgs = [sys_docs, {"role": "user", "content": f"Document {n + 1}:\n{documents[n]}\n\nQuestion: {q}"}]
            cls = DOC_FIRST if step == 1 else DOC_AGAIN
        else:
            msgs = [sys_chat]
            for user, reply in convs[n][:step - 1]:
                msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            msgs.append({"role": "user", "content": convs[n][step - 1][0]})
            cls = CHAT_FIRST if step == 1 else CHAT_NEXT
        out.append(DemoRequest(index=i, session=session, cls=cls, step=step, prompt=_ids(tokenizer, msgs)))
    return out


def distinct_blocks(requests: Sequence[DemoRequest], block_tokens: int) -> int:
    """Full blocks of distinct prefixes over all prompts: the KV working set
    a cache needs to serve every reuse in the workload."""
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        for b in range(len(r.prompt) // block_tokens):
            seen.add(tuple(r.prompt[:(b + 1) * block_tokens]))
    return len(seen)
