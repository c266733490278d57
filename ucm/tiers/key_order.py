"""The per-key order of a TierStack's steps (ucm/tiers/stack.py): a FIFO of
admitted steps per key, a step running once it heads its key's queue, and
the steps that free room in a tier (MOVE or DROP out of it) admitted and
not run yet, which a write that found no slot waits for. A leaf lock:
never held while an adapter is called."""
from __future__ import annotations

import threading
from collections import deque
from typing import Optional, Sequence

from ucm.adapters.base import Key
from ucm.placement.plans import Op, Step


class KeyOrder:
    """Per-key FIFO of admitted steps: a step runs once it heads its queue.
    Also the steps that free room in a tier (MOVE or DROP out of it),
    admitted and not run yet, by tier: `_frees[t]` holds their seqs."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[Key, deque[tuple[int, Step]]] = {}
        self._frees: dict[int, set[int]] = {}
        self._next = 0

    def admit(self, steps: Sequence[Step]) -> list[int]:
        with self._cond:
            seqs = []
            for s in steps:
                self._next += 1
                self._queues.setdefault(s.key, deque()).append((self._next, s))
                if s.op in (Op.MOVE, Op.DROP) and s.src is not None:
                    self._frees.setdefault(s.src, set()).add(self._next)
                seqs.append(self._next)
            return seqs

    def freed(self, t: int, seq: int) -> None:
        """The freeing step `seq` out of tier t ran (its delete is done)."""
        with self._cond:
            pending = self._frees.get(t)
            if pending is not None and seq in pending:
                pending.discard(seq)
                if not pending:
                    del self._frees[t]
                self._cond.notify_all()

    def frees_before(self, t: int, seq: Optional[int] = None) -> Optional[int]:
        """`seq` (None: every step admitted so far) when a freeing step out
        of tier t admitted before it has not run yet, else None."""
        with self._cond:
            bound = self._next + 1 if seq is None else seq
            return bound if any(n < bound for n in self._frees.get(t, ())) else None

    def wait_frees(self, t: int, seq: int, timeout_s: float) -> bool:
        """Waits until every freeing step out of tier t admitted before `seq`
        ran; False when `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not any(n < seq for n in self._frees.get(t, ())), timeout_s)

    def wait_turn(self, key: Key, seq: int) -> None:
        with self._cond:
            while self._queues[key][0][0] != seq:
                self._cond.wait()

    def after(self, key: Key, seq: int) -> list[Step]:
        """The steps of `key` admitted after `seq`, still queued."""
        with self._cond:
            return [s for n, s in self._queues.get(key, ()) if n > seq]

    def done(self, key: Key, seq: int) -> None:
        with self._cond:
            q = self._queues.get(key)
            if q is None:  # dequeued already
                return
            for i, (n, _) in enumerate(q):
                if n == seq:
                    del q[i]
                    break
            if not q:
                del self._queues[key]
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())
