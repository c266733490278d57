"""The scheduler side's prefetch policies (`ucm_prefetch_policy`): the
staging of a waiting request's hit below the landing tier (`stage`), its
admission in arrival order (`admit`, `leave`), the bounded wait of a
request whose hit the waiting-pin cap cut (`wait_for_room`), and
StagingBudget: how many blocks the scheduler side's prefetch policy may
have staged into the landing tier for requests that have not loaded them
yet. All of it runs in the scheduler process, on vLLM's scheduler thread
(not thread-safe).

Without a bound, the stagings of a queue longer than DRAM evict each
other's staged-but-unused blocks (each request then finds its own staging
gone and waits for another). Within the budget the staged blocks fit in
DRAM beside the running requests' own. A request seen on arrival whose
staging does not fit yet queues for it (`side._staging_queue`, arrival
order, no overtaking): its staging is issued as soon as the budget frees
(a staged request's load is planned, it is preempted or it finishes). A
request vLLM wants to run before its staging was issued, or whose staging
could never fit, is not staged (counted `over_budget`) and loads its hit as
without a policy (streamed or asynchronously): vLLM has room for it now,
and waiting would leave that room idle.

A staging that comes back short (blocks that found no room in DRAM, or
were evicted before use) is no loss: what reached DRAM loads from there,
the rest as without a policy (`short`). A late one (`timeout`, or
`wait_complete` past `load_timeout_s`) is a miss for the blocks still
below, counted as a loss (`late`); after MAX_STAGING_LOSSES the request is
computed without ucm, so nothing waits forever.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from ucm.api import Key
from ucm.connectors.vllm.load_choice import PENDING

if TYPE_CHECKING:
    from ucm.connectors.vllm.scheduler import UCMSchedulerSide
    from ucm.connectors.vllm.settings import ConnectorSettings

MAX_STAGING_LOSSES = 2  # late stagings after which a request is computed without ucm
MAX_LOAD_FAILURES = 2  # lost loads after which a request is computed without ucm
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


def wait_s(settings: "ConnectorSettings", hit_tokens: int) -> float:
    """How long a request of `hit_tokens` hit tokens may wait under its policy."""
    wait = settings.load_timeout_s
    if settings.prefetch_policy == "timeout":
        wait = min(wait, settings.prefetch_timeout_s + settings.prefetch_timeout_per_1k_tokens_s * hit_tokens / 1000)
    return wait


def _below(side: "UCMSchedulerSide", st: Any, first: int) -> list[Key]:
    return [st.keys[i] for i in range(first, st.hit_blocks) if st.hit_tiers[i] not in (side._landing, PENDING)]


def _issue(side: "UCMSchedulerSide", st: Any, below: list[Key], first: int) -> bool:
    """Stages `below` (its budget share taken); True when the policy waits for it."""
    handle = side._ask("prefetch", None, side._cache.prefetch, below)
    if handle is None:
        side.staging_budget.give_back(id(st))
        return False
    counts = side.staging_counts
    counts["stagings"] += 1
    counts["blocks_staged"] += len(below)
    st.staging, st.staged = handle, frozenset(below)
    st.staging_since = time.monotonic()
    st.staging_deadline = st.staging_since + wait_s(st.settings, (st.hit_blocks - first) * side.block_tokens)
    return st.settings.prefetch_policy != "best_effort"


def admit(side: "UCMSchedulerSide") -> None:
    """Issues the queued stagings, in arrival order, while the budget holds them."""
    queue = side._staging_queue
    while queue:
        owner, (st, first) = next(iter(queue.items()))
        below = _below(side, st, first)
        if not side.staging_budget.take(owner, len(below)):
            return
        del queue[owner]
        if below:
            _issue(side, st, below, first)


def leave(side: "UCMSchedulerSide", st: Any) -> None:
    """The request loads its blocks now, was preempted or finished: its
    budget share and its place in the queue go to the next requests."""
    side._staging_queue.pop(id(st), None)
    side.staging_budget.give_back(id(st))
    admit(side)


def wait_for_room(side: "UCMSchedulerSide", st: Any) -> bool:
    """True while a waiting request whose hit the waiting-pin cap cut waits
    for room (the waiting policies only, at most `wait_s`); it looks up
    again when room frees. No loss is counted: the cap is not a fault."""
    if st.settings.prefetch_policy not in WAITING_POLICIES or st.allocated:
        return False
    now = time.monotonic()
    if st.capped and not st.room_since:
        st.room_since = now
        st.room_deadline = now + wait_s(st.settings, len(st.keys) * side.block_tokens)
        side.staging_counts["capped_waits"] += 1
    waiting = st.room_since > 0
    if waiting and st.capped and now < st.room_deadline:
        return True
    if waiting:
        side.staging_wait_s += now - st.room_since
        st.room_since = -1.0  # waited once: from now on the hit it has
    return False


def stage(side: "UCMSchedulerSide", st: Any, first: int, arrival: bool = False) -> bool:
    """Stages the request's hit blocks that lie below the landing tier
    (after vLLM's own `first` blocks) by the prefetch policy; True while
    the request should wait for it (vLLM asks again next step). `arrival`:
    vLLM only added the request; a staging over the budget then queues."""
    policy = st.settings.prefetch_policy
    counts = side.staging_counts
    if st.staging is not None:
        now = time.monotonic()
        if st.staging.done():
            st.staging = None
            side._lookup(st)  # where the blocks are now
            if policy == "best_effort":
                return False  # what reached DRAM is loaded; nothing was waited for
            if _below(side, st, first):
                counts["short"] += 1
                st.unstaged = True  # the rest loads as without a policy
        elif policy == "best_effort":
            return False  # still staging: what is in DRAM now; a later ask looks again
        elif now >= st.staging_deadline:
            st.staging = None  # late: it goes on for later requests; this one stops waiting
            st.staging_losses += 1
            counts["late"] += 1
            side._lookup(st)
        else:
            return True
        side.staging_wait_s += now - st.staging_since
        if st.staging_losses >= MAX_STAGING_LOSSES:
            st.load_failures = MAX_LOAD_FAILURES
            counts["gave_up"] += 1
            side._lookup(st)  # a miss from now on
        return False
    if id(st) in side._staging_queue:  # vLLM runs it before its turn came
        del side._staging_queue[id(st)]
        counts["over_budget"] += 1
        st.unstaged = True
        admit(side)
        return False
    below = _below(side, st, first)
    if not below or st.staging_tried or st.staging_losses >= MAX_STAGING_LOSSES:
        return False
    st.staging_tried = True
    budget, n = side.staging_budget, len(below)
    if arrival and budget.could_hold(n):
        if side._staging_queue or not budget.take(id(st), n):  # behind the earlier arrivals
            side._staging_queue[id(st)] = (st, first)
            return False
    elif not budget.take(id(st), n):  # vLLM runs it now (or it never fits): no wait for room
        counts["over_budget"] += 1
        st.unstaged = True
        return False
    return _issue(side, st, below, first)
