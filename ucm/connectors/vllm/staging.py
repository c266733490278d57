"""The scheduler side's prefetch policies (`ucm_prefetch_policy`): the
staging of a waiting request's hit below the landing tier (`stage`), and
StagingBudget: how many blocks the scheduler side's prefetch policy may
have staged into the landing tier for requests that have not loaded them
yet, in the scheduler process (not thread-safe: vLLM's scheduler thread).

Without a bound, the stagings of a queue longer than DRAM evict each
other's staged-but-unused blocks (each request then finds its own staging
gone and waits for another). Within the budget the staged blocks fit in
DRAM beside the running requests' own; a staging that would pass it is not
issued (counted `over_budget`) and its request loads as without a policy
(streamed or asynchronously). A request gives its share back once its load
is planned (it reads the blocks now), when it is preempted or finished.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from ucm.connectors.vllm.load_choice import PENDING

if TYPE_CHECKING:
    from ucm.connectors.vllm.scheduler import UCMSchedulerSide

MAX_STAGING_LOSSES = 2  # short or late stagings after which a request is computed without ucm
MAX_LOAD_FAILURES = 2  # lost loads after which a request is computed without ucm


class StagingBudget:
    def __init__(self, max_blocks: Optional[int]) -> None:
        """`max_blocks`: None for no bound."""
        self.max_blocks = max_blocks
        self.used = 0
        self._held: dict[int, int] = {}  # request (its state's id) -> blocks staged for it, not loaded yet

    def take(self, owner: int, n: int) -> bool:
        """Room for `n` more blocks staged for `owner`: taken, or False."""
        if self.max_blocks is not None and self.used + n > self.max_blocks:
            return False
        self._held[owner] = self._held.get(owner, 0) + n
        self.used += n
        return True

    def give_back(self, owner: int) -> None:
        self.used -= self._held.pop(owner, 0)


def stage(side: "UCMSchedulerSide", st: Any, first: int) -> bool:
    """Stages the request's hit blocks that lie below the landing tier
    (after vLLM's own `first` blocks) by the prefetch policy; True while
    the request should wait for it (vLLM asks again next step). A
    staging that comes back short or late counts as lost (the hit then
    stops at the first block still below); after MAX_STAGING_LOSSES the
    request is computed without ucm."""
    policy = side.settings.prefetch_policy
    counts = side.staging_counts
    if st.staging is not None:
        now = time.monotonic()
        if st.staging.done():
            st.staging = None
            side._lookup(st)  # where the blocks are now
            short = any(t not in (side._landing, PENDING) for t in st.hit_tiers[first:st.hit_blocks])
            if policy == "best_effort":
                return False  # what reached DRAM is loaded; nothing was waited for
            if short:
                st.staging_losses += 1
                counts["short"] += 1
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
    below = [st.keys[i] for i in range(first, st.hit_blocks) if st.hit_tiers[i] not in (side._landing, PENDING)]
    if not below or st.staging_tried or st.staging_losses >= MAX_STAGING_LOSSES:
        return False
    st.staging_tried = True
    if not side.staging_budget.take(id(st), len(below)):
        counts["over_budget"] += 1
        st.unstaged = True
        return False
    handle = side._ask("prefetch", None, side._cache.prefetch, below)
    if handle is None:
        side.staging_budget.give_back(id(st))
        return False
    counts["stagings"] += 1
    counts["blocks_staged"] += len(below)
    st.staging = handle
    st.staging_since = time.monotonic()
    if policy == "best_effort":
        return False  # the tiers are looked at again once it is done
    wait = side.settings.load_timeout_s
    if policy == "timeout":
        hit_tokens = (st.hit_blocks - first) * side.block_tokens
        wait = min(wait, side.settings.prefetch_timeout_s
                   + side.settings.prefetch_timeout_per_1k_tokens_s * hit_tokens / 1000)
    st.staging_deadline = st.staging_since + wait
    return True
