"""PrefetchPolicy: the scheduler side's prefetch policies
(`ucm_prefetch_policy`). It stages a waiting request's hit below the
landing tier (`stage`, then `settle` once the staging ended and the
scheduler side looked the request up again), admits stagings in arrival
order under a StagingBudget (`leave` gives a request's share back), and
bounds the wait of a request whose hit the waiting-pin cap cut
(`wait_for_room`). It owns the queue, the budget and the figures
(`stats`); the scheduler side owns the lookups and pins, and is told by
the returned StagingStep when to look a request up again. All of it runs
in the scheduler process, on vLLM's scheduler thread (not thread-safe).

StagingBudget bounds how many blocks stagings may have brought into the
landing tier for requests that have not loaded them yet. Without a bound,
the stagings of a queue longer than DRAM evict each other's
staged-but-unused blocks (each request then finds its own staging gone and
waits for another). Within the budget the staged blocks fit in DRAM beside
the running requests' own. A request seen on arrival whose staging does not
fit yet queues for it (arrival order, no overtaking): its staging is issued
as soon as the budget frees (a staged request's load is planned, it is
preempted or it finishes). A request vLLM wants to run before its staging
was issued, or whose staging could never fit, is not staged (counted
`over_budget`) and loads its hit as without a policy (streamed or
asynchronously): vLLM has room for it now, and waiting would leave that
room idle.

A staging that comes back short (blocks that found no room in DRAM, or
were evicted before use) is no loss: what reached DRAM loads from there,
the rest as without a policy (`short`). A late one (`timeout`, or
`wait_complete` past `load_timeout_s`) is a miss for the blocks still
below, counted as a loss (`late`); after MAX_STAGING_LOSSES the request is
computed without ucm, so nothing waits forever.
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Optional

from ucm.api import Handle, Key
from ucm.connectors.vllm.load_choice import PENDING
from ucm.connectors.vllm.request_state import MAX_LOAD_FAILURES, ReqState
from ucm.connectors.vllm.settings import ConnectorSettings

MAX_STAGING_LOSSES = 2  # late stagings after which a request is computed without ucm
WAITING_POLICIES = ("wait_complete", "timeout")  # the policies that answer None while they wait


class StagingBudget:
    def __init__(self, max_blocks: Optional[int]) -> None:
        """`max_blocks`: None for no bound."""
        self.max_blocks = max_blocks
        self.used = 0
        self._held: dict[int, int] = {}  # request (its state's id) -> blocks staged for it, not loaded yet

    def could_hold(self, n: int) -> bool:
        """Whether `n` blocks fit once nothing else is staged."""
        return self.max_blocks is None or n <= self.max_blocks

    def take(self, owner: int, n: int) -> bool:
        """Room for `n` more blocks staged for `owner`: taken, or False."""
        if self.max_blocks is not None and self.used + n > self.max_blocks:
            return False
        self._held[owner] = self._held.get(owner, 0) + n
        self.used += n
        return True

    def give_back(self, owner: int) -> None:
        self.used -= self._held.pop(owner, 0)


class StagingStep(enum.Enum):
    """What `PrefetchPolicy.stage` asks of the scheduler side."""
    WAIT = "wait"  # the request waits for its staging: answer None, vLLM asks again next step
    GO = "go"  # answer vLLM now with what the last lookup found
    ARRIVED = "arrived"  # the staging finished: look the request up again, then `settle`
    LATE = "late"  # the staging is late (no longer waited for): look up again, then `settle`


def wait_s(settings: ConnectorSettings, hit_tokens: int) -> float:
    """How long a request of `hit_tokens` hit tokens may wait under its policy."""
    wait = settings.load_timeout_s
    if settings.prefetch_policy == "timeout":
        wait = min(wait, settings.prefetch_timeout_s + settings.prefetch_timeout_per_1k_tokens_s * hit_tokens / 1000)
    return wait


class PrefetchPolicy:
    """The stagings of one scheduler side; see the module docstring."""

    def __init__(self, prefetch: Callable[[list[Key]], Optional[Handle]], *, landing_tier: str,
                 block_tokens: int, max_staging_blocks: Optional[int] = None) -> None:
        """`prefetch(keys)`: stages `keys` into the landing tier and returns
        the handle, or None when the cache failed (a miss: nothing is
        staged); `max_staging_blocks`: the StagingBudget (None: unbounded)."""
        self._prefetch = prefetch
        self._landing = landing_tier
        self._block_tokens = block_tokens
        self.budget = StagingBudget(max_staging_blocks)  # staged, not yet loaded
        # Stagings issued and their blocks, those that came back short or
        # late, the requests then computed without ucm, those over the budget
        # and the capped requests that waited for room (`stats`).
        self.counts = {"stagings": 0, "blocks_staged": 0, "short": 0, "late": 0, "gave_up": 0,
                       "over_budget": 0, "capped_waits": 0}
        self.wait_s = 0.0  # seconds requests waited for staging or room, in all
        # Requests seen on arrival whose staging waits for budget, in arrival order (`_admit`).
        self._queue: dict[int, tuple[ReqState, int]] = {}

    def stats(self) -> dict[str, float]:
        """The figures (a snapshot): `counts` and `wait_s`."""
        return {**self.counts, "wait_s": round(self.wait_s, 6)}

    def _below(self, st: ReqState, first: int) -> list[Key]:
        return [st.keys[i] for i in range(first, st.hit_blocks) if st.hit_tiers[i] not in (self._landing, PENDING)]

    def _issue(self, st: ReqState, below: list[Key], first: int) -> bool:
        """Stages `below` (its budget share taken); True when the policy waits for it."""
        handle = self._prefetch(below)
        if handle is None:
            self.budget.give_back(id(st))
            return False
        self.counts["stagings"] += 1
        self.counts["blocks_staged"] += len(below)
        st.staging, st.staged = handle, frozenset(below)
        st.staging_since = time.monotonic()
        st.staging_deadline = st.staging_since + wait_s(st.settings, (st.hit_blocks - first) * self._block_tokens)
        return st.settings.prefetch_policy != "best_effort"

    def _admit(self) -> None:
        """Issues the queued stagings, in arrival order, while the budget holds them."""
        queue = self._queue
        while queue:
            owner, (st, first) = next(iter(queue.items()))
            below = self._below(st, first)
            if not self.budget.take(owner, len(below)):
                return
            del queue[owner]
            if below:
                self._issue(st, below, first)

    def leave(self, st: ReqState) -> None:
        """The request loads its blocks now, was preempted or finished: its
        budget share and its place in the queue go to the next requests."""
        self._queue.pop(id(st), None)
        self.budget.give_back(id(st))
        self._admit()

    def wait_for_room(self, st: ReqState) -> bool:
        """True while a waiting request whose hit the waiting-pin cap cut waits
        for room (the waiting policies only, at most `wait_s`); it looks up
        again when room frees. No loss is counted: the cap is not a fault."""
        if st.settings.prefetch_policy not in WAITING_POLICIES or st.allocated:
            return False
        now = time.monotonic()
        if st.capped and not st.room_since:
            st.room_since = now
            st.room_deadline = now + wait_s(st.settings, len(st.keys) * self._block_tokens)
            self.counts["capped_waits"] += 1
        waiting = st.room_since > 0
        if waiting and st.capped and now < st.room_deadline:
            return True
        if waiting:
            self.wait_s += now - st.room_since
            st.room_since = -1.0  # waited once: from now on the hit it has
        return False

    def stage(self, st: ReqState, first: int, arrival: bool = False) -> StagingStep:
        """Stages the request's hit blocks that lie below the landing tier
        (after vLLM's own `first` blocks) by the prefetch policy. WAIT while
        the request should wait for it; ARRIVED or LATE when its staging
        ended: the scheduler side then looks it up again (where the blocks
        are now) and calls `settle`. `arrival`: vLLM only added the request;
        a staging over the budget then queues."""
        policy = st.settings.prefetch_policy
        counts = self.counts
        if st.staging is not None:
            now = time.monotonic()
            if st.staging.done():
                st.staging = None
                if policy != "best_effort":  # under best_effort nothing was waited for
                    self.wait_s += now - st.staging_since
                return StagingStep.ARRIVED
            if policy == "best_effort":
                return StagingStep.GO  # still staging: what is in DRAM now; a later ask looks again
            if now >= st.staging_deadline:
                st.staging = None  # late: it goes on for later requests; this one stops waiting
                st.staging_losses += 1
                counts["late"] += 1
                self.wait_s += now - st.staging_since
                return StagingStep.LATE
            return StagingStep.WAIT
        if id(st) in self._queue:  # vLLM runs it before its turn came
            del self._queue[id(st)]
            counts["over_budget"] += 1
            st.unstaged = True
            self._admit()
            return StagingStep.GO
        below = self._below(st, first)
        if not below or st.staging_tried or st.staging_losses >= MAX_STAGING_LOSSES:
            return StagingStep.GO
        st.staging_tried = True
        budget, n = self.budget, len(below)
        if arrival and budget.could_hold(n):
            if self._queue or not budget.take(id(st), n):  # behind the earlier arrivals
                self._queue[id(st)] = (st, first)
                return StagingStep.GO
        elif not budget.take(id(st), n):  # vLLM runs it now (or it never fits): no wait for room
            counts["over_budget"] += 1
            st.unstaged = True
            return StagingStep.GO
        return StagingStep.WAIT if self._issue(st, below, first) else StagingStep.GO

    def settle(self, st: ReqState, first: int, step: StagingStep) -> bool:
        """After `stage` answered ARRIVED or LATE (`step`) and the scheduler
        side looked the request up again: blocks an arrived staging left
        below the landing tier load as without a policy (`short`). True when
        the request has lost too many stagings and is computed without ucm
        from now on (`gave_up`): the scheduler side looks it up again, a
        miss."""
        if step is StagingStep.ARRIVED:
            if st.settings.prefetch_policy == "best_effort":
                return False  # what reached DRAM is loaded; nothing was waited for
            if self._below(st, first):
                self.counts["short"] += 1
                st.unstaged = True  # the rest loads as without a policy
        if st.staging_losses >= MAX_STAGING_LOSSES:
            st.load_failures = MAX_LOAD_FAILURES
            self.counts["gave_up"] += 1
            return True
        return False
