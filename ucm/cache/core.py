"""CacheCore: what the parts of one UnifiedCache share, with public seams.

A UnifiedCache is one object to its callers; inside, its jobs are objects
of their own (ucm/cache/__init__.py lists them) that act on one CacheCore:
the tiers and their adapters, the placement engine and the plan executor,
the metadata lock, the request bookkeeping, the counters and the
accelerator chain. The parts never reach into each other; each takes the
core (and the other parts it calls) in its constructor and uses only what
is public here.

Locks. `meta` guards the placement metadata and the request bookkeeping
(every method named `..._locked` expects it held); it is held only to plan
and to reconcile, never across an adapter's I/O. Lock order: `meta`, then
the TierStack's order lock, then an adapter's own lock; the counters' lock
is a leaf.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

from ucm.adapters.base import SharedSlots, StorageAdapter
from ucm.api import Key
from ucm.cache.counters import Counters
from ucm.errors import ArgumentError, ClosedError

# Request ids remembered (begun, not finished yet): a bound, so that ids
# never finished (a crashed engine) cannot grow the cache's memory.
MAX_OPEN_REQUESTS = 65536


class CacheCore:
    """The shared state of one cache. Built once its tiers are open; every
    attribute is set at construction and never rebound, except
    `accelerators` (built last, once the cache can serve their calls),
    `wake_reclaim` (the headroom thread's wake, when a tier keeps
    headroom) and `write_through` (blocks just stored, handed to the
    WriteThrough part when a tier is configured so)."""

    def __init__(self, config: Any, tier_names: Sequence[str], adapters: Sequence[StorageAdapter], tiers: Any,
                 layouts: Any, heat: Any, placement: Any, meta: threading.Lock, plans: Any,
                 counters: Counters) -> None:
        self.config = config
        self.tier_names = list(tier_names)
        self.adapters = list(adapters)
        self.tiers = tiers
        self.layouts = layouts
        self.heat = heat
        self.placement = placement
        self.meta = meta
        self.plans = plans
        self.counters = counters
        self.accelerators: Any = None
        self.shared = tiers.shared  # tiers other nodes write: asked directly on a miss
        self.wake_reclaim: Callable[[], None] = lambda: None
        self.write_through: Callable[[Sequence[Key]], None] = lambda keys: None
        self._requests: OrderedDict[str, None] = OrderedDict()
        self._requests_counted = 0  # request events the policy saw (ticks of the heat clock)
        self._closed = False

    # ---- the tiers -----------------------------------------------------------
    @property
    def landing(self) -> int:
        return self.placement.landing

    def shared_arena(self) -> Optional[SharedSlots]:
        """The landing tier when it declares shared slots, else None."""
        a = self.adapters[self.placement.landing]
        return a if isinstance(a, SharedSlots) else None

    def footprint(self, size: int) -> int:
        """What a block of `size` bytes takes in the landing tier."""
        return self.adapters[self.placement.landing].footprint_bytes(size)

    def tier_index(self, name: str) -> int:
        if name not in self.tier_names:
            raise ArgumentError(f"unknown tier {name!r}; configured: {self.tier_names}")
        return self.tier_names.index(name)

    # ---- requests (under `meta`) ------------------------------------------------
    def record_locked(self, keys: Sequence[Key], parent: Optional[Key], request_id: Optional[str],
                      counted: bool = True) -> bool:
        """Counts the request's access unless `request_id` was begun already
        (or, without an id, unless the call continues one already counted:
        `counted` False, a later chunk of one client call). True if counted."""
        if request_id is None and not counted:
            return False
        if request_id is not None:
            if request_id in self._requests:
                self._requests.move_to_end(request_id)
                return False
            self._requests[request_id] = None
            if len(self._requests) > MAX_OPEN_REQUESTS:
                self._requests.popitem(last=False)
        self.placement.record_request(keys, parent=parent)
        self._requests_counted += 1
        return True

    def forget_request_locked(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def request_figures_locked(self) -> tuple[int, int]:
        """(requests open now, request events counted since the start)."""
        return len(self._requests), self._requests_counted

    # ---- life ------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def mark_closed(self) -> None:
        self._closed = True

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("UnifiedCache used after close()")
