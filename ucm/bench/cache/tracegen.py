"""`ucm bench tracegen`: synthetic request traces in the Mooncake format.

Writes workloads other than the development trace, so that placement
policies can be checked on traffic they were not designed against. Each
workload is a stream of sessions arriving as a Poisson process; a session
sends one or more requests, each prompt extending the session's context.
Block ids are chained as in the Mooncake format: a full 512-token block
keeps its id while the context before it is unchanged; the partly filled
last block of a prompt gets a new id whenever text is appended to it. A
shared prefix (a system prompt, a tool specification, a template) has the
same ids in every session that starts with it.

Workloads (every size and time drawn from the seeded generator):
- `chat`: multi-turn conversations; a system prompt from a pool with Zipf
  popularity, a heavy-tailed number of turns, think times from seconds to
  many minutes; each turn sends the whole conversation so far.
- `sysprompt`: single-turn requests, each a template (system prompt,
  few-shot examples) from a large pool with Zipf popularity plus a unique
  question.
- `agent`: tool loops: a tool specification shared by all, a task, then
  tens of quick steps each appending the model's call and a long tool
  result, so contexts grow to tens of thousands of tokens.
- `rag`: retrieval-augmented single-turn requests: a short shared header,
  then retrieved chunks from a large corpus (Zipf), then a question; as
  chained ids see it, mostly unique prompts with a hot head.
- `scan`: the chat workload with batch jobs mixed in: bursts of long
  one-shot documents (summarisation) that flush a recency-ordered cache.

Pure generation: no placement; writes JSON Lines to a file or stdout.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, TextIO

from ucm.bench.cache.traces import BLOCK_TOKENS
from ucm.bench.common import Subparsers, add_bench
from ucm.errors import ArgumentError

WORKLOADS = ("chat", "sysprompt", "agent", "rag", "scan")


class Ids:
    """Allocator of fresh block ids, shared by every context of a trace."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def new(self) -> int:
        return next(self._next)


@dataclass(slots=True)
class Context:
    """The token sequence a session sends, as chained block ids: `full` for
    the complete blocks, `part` (id, tokens) for the partly filled last one."""

    ids: Ids
    full: list[int] = field(default_factory=list)
    part_tokens: int = 0
    part_id: Optional[int] = None

    def fork(self) -> "Context":
        """A context starting with this one (shared ids up to the last full
        block; the partly filled block is shared until either side appends)."""
        return Context(self.ids, list(self.full), self.part_tokens, self.part_id)

    def extend(self, tokens: int) -> None:
        """Appends `tokens` of new text."""
        if tokens <= 0:
            return
        total = self.part_tokens + tokens
        whole, self.part_tokens = divmod(total, BLOCK_TOKENS)
        self.full.extend(self.ids.new() for _ in range(whole))
        self.part_id = self.ids.new() if self.part_tokens else None

    @property
    def tokens(self) -> int:
        return len(self.full) * BLOCK_TOKENS + self.part_tokens

    def hash_ids(self) -> list[int]:
        return self.full + ([self.part_id] if self.part_id is not None else [])


def lognormal(rnd: random.Random, median: float, sigma: float, lo: float = 1.0,
              hi: float = math.inf) -> float:
    return min(hi, max(lo, median * math.exp(rnd.gauss(0.0, sigma))))


class Zipf:
    """Ranks 0..n-1 with P(k) proportional to 1 / (k + 1)**s."""

    def __init__(self, n: int, s: float) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total = sum(weights)
        self._cum = list(itertools.accumulate(w / total for w in weights))

    def draw(self, rnd: random.Random) -> int:
        return min(bisect.bisect_left(self._cum, rnd.random()), len(self._cum) - 1)


class Pool:
    """Shared prefixes (system prompts, templates, tool specs), built on first use."""

    def __init__(self, ids: Ids, n: int, s: float, length: Callable[[], float]) -> None:
        self._ids = ids
        self._zipf = Zipf(n, s)
        self._length = length
        self._made: dict[int, Context] = {}

    def draw(self, rnd: random.Random) -> Context:
        k = self._zipf.draw(rnd)
        ctx = self._made.get(k)
        if ctx is None:
            ctx = Context(self._ids)
            ctx.extend(int(self._length()))
            self._made[k] = ctx
        return ctx.fork()


# A session is an iterator of (delay_s before the request, context to send,
# output tokens); it may change the context after each yield.
Session = Iterator[tuple[float, Context, int]]


@dataclass(frozen=True, slots=True)
class Workload:
    sessions_per_s: float
    start: Callable[[random.Random], Session]


def _chat(ids: Ids, rnd: random.Random) -> Callable[[random.Random], Session]:
    prompts = Pool(ids, 50, 1.1, lambda: lognormal(rnd, 1200, 0.8, 100, 8000))

    def session(r: random.Random) -> Session:
        ctx = prompts.draw(r)
        turns = max(1, int(lognormal(r, 3, 1.0, 1, 60)))
        think_median = lognormal(r, 40, 1.0, 3, 1800)  # users differ
        delay = 0.0
        for _ in range(turns):
            ctx.extend(int(lognormal(r, 150, 1.0, 5, 4000)))  # the user's message
            out = int(lognormal(r, 250, 0.8, 5, 2000))
            yield delay, ctx, out
            ctx.extend(out)
            delay = lognormal(r, think_median, 0.7, 1)

    return session


def _sysprompt(ids: Ids, rnd: random.Random) -> Callable[[random.Random], Session]:
    templates = Pool(ids, 2000, 0.9, lambda: lognormal(rnd, 2500, 0.7, 200, 20000))

    def session(r: random.Random) -> Session:
        ctx = templates.draw(r)
        ctx.extend(int(lognormal(r, 300, 1.0, 10, 6000)))
        yield 0.0, ctx, int(lognormal(r, 200, 0.8, 5, 2000))

    return session


def _agent(ids: Ids, rnd: random.Random) -> Callable[[random.Random], Session]:
    tools = Pool(ids, 8, 1.2, lambda: lognormal(rnd, 3000, 0.5, 500, 12000))

    def session(r: random.Random) -> Session:
        ctx = tools.draw(r)
        ctx.extend(int(lognormal(r, 800, 0.8, 50, 8000)))  # the task
        steps = max(1, int(lognormal(r, 15, 0.8, 1, 120)))
        delay = 0.0
        for _ in range(steps):
            out = int(lognormal(r, 120, 0.7, 10, 1500))  # the tool call
            yield delay, ctx, out
            ctx.extend(out)
            ctx.extend(int(lognormal(r, 600, 1.2, 10, 20000)))  # the tool result
            delay = lognormal(r, 3, 1.0, 0.2, 300)
            if ctx.tokens > 120_000:
                break

    return session


def _rag(ids: Ids, rnd: random.Random) -> Callable[[random.Random], Session]:
    headers = Pool(ids, 3, 1.0, lambda: lognormal(rnd, 600, 0.3, 100, 2000))
    corpus = Zipf(200_000, 0.8)
    chunks: dict[tuple, Context] = {}

    def chunk(ctx: Context, doc: int) -> Context:
        """`ctx` followed by document `doc`: the same ids whenever the same
        document follows the same prefix (chained ids share nothing else)."""
        key = (tuple(ctx.full), ctx.part_id, doc)
        made = chunks.get(key)
        if made is None:
            made = ctx.fork()
            made.extend(int(lognormal(random.Random(doc), 700, 0.5, 100, 4000)))
            chunks[key] = made
        return made.fork()

    def session(r: random.Random) -> Session:
        ctx = headers.draw(r)
        for _ in range(r.randint(3, 8)):
            ctx = chunk(ctx, corpus.draw(r))
        ctx.extend(int(lognormal(r, 60, 0.7, 5, 600)))  # the question
        yield 0.0, ctx, int(lognormal(r, 250, 0.8, 5, 2000))

    return session


def _scan(ids: Ids, rnd: random.Random) -> Callable[[random.Random], Session]:
    chat = _chat(ids, rnd)

    def session(r: random.Random) -> Session:
        if r.random() < 0.95:
            yield from chat(r)
            return
        # a batch job: a burst of long unique documents, one after the other
        delay = 0.0
        for _ in range(r.randint(5, 40)):
            ctx = Context(ids)
            ctx.extend(int(lognormal(r, 12000, 0.6, 2000, 100_000)))
            yield delay, ctx, int(lognormal(r, 300, 0.5, 20, 2000))
            delay = lognormal(r, 0.5, 0.5, 0.05)

    return session


_MAKERS = {"chat": (_chat, 0.9), "sysprompt": (_sysprompt, 4.0), "agent": (_agent, 0.3),
           "rag": (_rag, 4.0), "scan": (_scan, 0.9)}


def workload(name: str, ids: Ids, rnd: random.Random) -> Workload:
    if name not in _MAKERS:
        raise ArgumentError(f"unknown workload {name!r}; choose one of {list(WORKLOADS)}")
    make, rate = _MAKERS[name]
    return Workload(rate, make(ids, rnd))


def generate(name: str, requests: int, seed: int = 0) -> Iterator[dict]:
    """The first `requests` requests of workload `name`, in time order, as
    Mooncake trace records (timestamp in ms)."""
    if requests <= 0:
        raise ArgumentError(f"requests must be > 0, got {requests}")
    rnd = random.Random(seed)
    w = workload(name, Ids(), rnd)
    # (time_s, order, session, pending request)
    heap: list[tuple[float, int, Session, tuple[Context, int]]] = []
    order = itertools.count()
    next_arrival = 0.0
    emitted = 0
    while emitted < requests:
        while not heap or next_arrival <= heap[0][0]:
            s = w.start(random.Random(rnd.getrandbits(64)))
            first = next(s, None)
            if first is not None:
                heapq.heappush(heap, (next_arrival + first[0], next(order), s, first[1:]))
            next_arrival += rnd.expovariate(w.sessions_per_s)
        t, _, s, (ctx, out) = heapq.heappop(heap)
        ids = ctx.hash_ids()
        if ids:
            yield {"timestamp": int(t * 1000), "input_length": ctx.tokens,
                   "output_length": out, "hash_ids": ids}
            emitted += 1
        nxt = next(s, None)  # the session appends its output and next message
        if nxt is not None:
            heapq.heappush(heap, (t + nxt[0], next(order), s, nxt[1:]))


def write(name: str, requests: int, seed: int, out: TextIO) -> int:
    n = 0
    for rec in generate(name, requests, seed):
        out.write(json.dumps(rec) + "\n")
        n += 1
    return n


def handle(args: argparse.Namespace) -> int:
    if args.out in (None, "-"):
        write(args.workload, args.requests, args.seed, sys.stdout)
    else:
        with open(args.out, "w", encoding="utf-8") as f:
            write(args.workload, args.requests, args.seed, f)
    return 0


def register(subparsers: Subparsers) -> None:
    add_bench(subparsers, "tracegen", help="write a synthetic request trace (Mooncake format) for `ucm bench trace`",
              description=(
                  "Generate a synthetic workload as a Mooncake-format trace (one JSON request per "
                  "line, hash_ids = chained ids of 512-token blocks), to check placement policies "
                  "on traffic other than the development trace. Workloads: chat (multi-turn, Zipf "
                  "system prompts, varied think times), sysprompt (single-turn over Zipf templates), "
                  "agent (tool loops with long growing contexts), rag (mostly unique retrieved "
                  "chunks), scan (chat with bursts of long one-shot documents). Same seed, same "
                  "trace."),
              add_args=_add_args, handler=handle, raw_description=False)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=4000, metavar="N",
                   help="number of requests (default 4000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out", metavar="FILE", help="output file (default: stdout)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm.bench.cache.tracegen")
    sub = parser.add_subparsers(dest="bench", required=True)
    register(sub)
    args = parser.parse_args(["tracegen", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
