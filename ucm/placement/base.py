"""PlacementEngine: the one interface of block placement, whichever engine
runs it.

An engine keeps, per tier, the resident blocks, their bytes and a placement
policy; across tiers, the prefix tree (parents and resident children), pins
and holds. It never touches payloads: its changes return a `Plan`, a list of
`Step`s the caller executes in order (UnifiedCache through the plan
executor, ucm/tiers/executor.py; the trace replay ignores them; the
vocabulary is in ucm/placement/plans.py). Metadata is updated when the plan
is made; a step that fails afterwards is reported back with `remove()`.

Two engines implement it and make exactly the same decisions: the Python
reference (`PythonPlacement`, ucm/placement/engine.py, any policy) and the
C++ core (`NativePlacement`, ucm/placement/native.py, the policies with a
native twin). `make_placement` (ucm/placement/factory.py) picks one; the
callers hold a `PlacementEngine` and never ask which.
tests/unit/test_placement_engines.py checks that both engines define every
method here; tests/unit/test_placement_native.py compares their plans.

Invariants every engine keeps:
- a block is resident in a tier only if its parent is resident somewhere
  (a child without its prefix is useless), so a parent never leaves the
  cache before its children;
- a held block (`hold`: a reservation being written, a block being staged
  or read) is never a victim; a pinned block (`pin`: a hit promised to an
  engine) never leaves the cache: it is a victim in a tier only while
  another tier holds it too (dropping that copy keeps it cached), so a
  reader staging its own pinned prefix through a small tier can always make
  room from the copies it staged before;
- within a tier, blocks with resident children there are victims only when
  nothing else is evictable, and then only by demotion to the tier below
  (the prefix stays cached);
- `used_bytes(t) <= capacity_bytes(t)` after every operation.

Batched calls: `record_request` and `touch` take a request's keys, and
`insert_run` stores a run of consecutive blocks of one prompt with one plan,
so the owner takes its lock once per request. They make exactly the
decisions of the per-block calls made in the same order.

Not thread-safe: the owner serialises calls (the native core releases the
GIL in its batched calls, so unserialised calls are a data race there).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

from ucm.placement.heat import HeatTracker, Key
from ucm.placement.plans import Decision, Plan, RunDecision, TierCounters


@runtime_checkable
class PlacementEngine(Protocol):
    """Block placement over an ordered stack of tiers (index 0 fastest)."""

    heat: HeatTracker  # the access history the policies read (updated by `record_request`)
    landing: int  # the tier new blocks and promotions go to
    native: bool  # whether this engine runs on the C++ core

    # ---- queries -----------------------------------------------------------
    @property
    def tier_count(self) -> int: ...

    def tier_name(self, t: int) -> str: ...

    def capacity_bytes(self, t: int) -> int: ...

    def used_bytes(self, t: int) -> int: ...

    def blocks(self, t: int) -> int:
        """How many blocks tier t holds."""

    def counters(self, t: int) -> TierCounters:
        """Tier t's counters (the native engine answers a snapshot)."""

    def contains(self, key: Key) -> bool:
        """Whether `key` is cached in some tier."""

    def tiers_of(self, key: Key) -> list[int]:
        """The tiers holding `key`, fastest first."""

    def where(self, key: Key) -> Optional[int]:
        """Fastest tier holding `key`, or None."""

    def lookup(self, keys: Sequence[Key]) -> int:
        """Length of the longest prefix of `keys` cached in some tier."""

    def locate(self, keys: Sequence[Key]) -> list[Optional[int]]:
        """Per key, the fastest tier holding it, or None."""

    def size_of(self, key: Key) -> Optional[int]:
        """The bytes placement counts for a cached block, or None."""

    def parent_of(self, key: Key) -> Optional[Key]:
        """The parent of a cached block (None for a root or an unknown key)."""

    def resident_keys(self, t: int) -> Iterable[Key]:
        """The blocks tier t holds (the native engine answers a snapshot)."""

    # ---- pins and holds ------------------------------------------------------
    def pin(self, keys: Iterable[Key]) -> None:
        """Counted: the blocks stay cached (in some tier) until unpinned."""

    def unpin(self, keys: Iterable[Key]) -> None: ...

    def hold(self, keys: Iterable[Key]) -> None:
        """Counted: the blocks stay in every tier they are in until unheld
        (their bytes are being written, staged or read there)."""

    def unhold(self, keys: Iterable[Key]) -> None: ...

    # ---- accesses ----------------------------------------------------------
    def record_request(self, keys: Sequence[Key], next_uses: Optional[Sequence[float]] = None,
                       parent: Optional[Key] = None) -> None:
        """Counts one access to each block of a request in the HeatTracker
        (call once per request before lookups and inserts); deepest first.
        `parent`: the block before keys[0] (a store that continues a cached
        prefix), so the tracker knows what keys[0] follows. `next_uses`
        (trace replay): one number per key, not NaN, else ArgumentError
        before anything is recorded. Every access must reach the tracker
        through this call (the native core keeps its own copy of what its
        policies read)."""

    def finish_request(self, keys: Sequence[Key], output_tokens: int) -> None:
        """The request that used `keys` finished after generating
        `output_tokens` tokens: tells the HeatTracker, then, for each block
        whose kind changed, the policy of every tier holding it
        (`on_reclass`)."""

    def touch(self, keys: Sequence[Key]) -> None:
        """Reports that the resident blocks among `keys` were used by a
        request: one `on_hit` to the tier serving each, deepest block first."""

    # ---- changes -----------------------------------------------------------
    def insert(self, key: Key, parent: Optional[Key], size_bytes: int,
               tier: Optional[int] = None, restored: bool = False) -> Decision:
        """Places a new block (bytes from the caller) into `tier` (default the
        landing tier); the plan then ends in a WRITE step. Not placed when the
        block is already resident (empty plan), its parent is not resident,
        the policy refused it, or no room could be made. `restored` records a
        block found in the tier at start-up: no admission, no WRITE step."""

    def insert_run(self, keys: Sequence[Key], parent: Optional[Key], sizes: Sequence[int],
                   tier: Optional[int] = None) -> RunDecision:
        """Stores consecutive blocks of one prompt: `keys[0]` behind `parent`,
        each later key behind the one before it, with `sizes[i]` bytes each,
        into `tier` (default the landing tier). The same decisions as
        `insert(keys[i], keys[i - 1], sizes[i])` for each key in order,
        skipping keys already cached, stopping at the first key that is
        neither placed nor cached (its descendants would be useless); one
        plan for the run, each placed block's WRITE step after the steps
        that made its room."""

    def promote(self, key: Key, force: bool = False) -> Decision:
        """After a hit served below the landing tier: copies the block up if
        the landing tier's policy admits it (COPY step; the lower copy stays).
        `force` skips admission: the block must be staged (a reader needs it
        in the landing tier's shared memory). A placed promotion tells the
        source tier's policy (`on_copied_up`)."""

    def reclaim(self, t: int, free_bytes: int, max_victims: int) -> Plan:
        """Evicts up to `max_victims` of tier t's victims (demoted as on any
        eviction) while less than `free_bytes` of it is free: room made
        ahead of need. The plan is empty when there is room already."""

    def may_evict(self, t: int, keys: Iterable[Key], protect: Optional[Key] = None,
                  relaxed: bool = False) -> bool:
        """Whether `evict_keys(t, keys)` would evict every one of `keys`: each
        is resident in tier t, not pinned and not `protect`; a child of one
        that is resident in t is one of them too (children go first), unless
        `relaxed` in a tier that is not the lowest (a parent is demoted ahead
        of its children, as when only parents are left); and in the lowest
        tier a block held nowhere else leaves only with every child it has,
        which must be held nowhere else either (a parent never leaves the
        cache while a child is cached)."""

    def evict_keys(self, t: int, keys: Iterable[Key], any_one: bool = False,
                   protect: Optional[Key] = None, relaxed: bool = False) -> Plan:
        """Evicts from tier t blocks an adapter names because it needs those
        very blocks gone (the DRAM arena emptying an extent for another size
        class), demoted or dropped exactly as any eviction. `any_one`: only
        the policy's victim among `keys` (its evictable blocks; `relaxed`
        also its parents, outside the lowest tier). Otherwise all of them,
        children before parents, or none when `may_evict` says no. `protect`
        (the parent of the block that needs the room) never goes. The plan
        is empty when nothing was evicted."""

    def remove(self, key: Key, tier: Optional[int] = None) -> Plan:
        """A tier lost `key` (failed write, corrupt bytes, adapter eviction,
        explicit delete); with tier None every copy is gone. If no copy is
        left, its resident descendants are useless and are dropped too: the
        returned DROP steps name them (the caller deletes their bytes)."""

    def watch(self, on_link: Callable[[Key], None], on_unlink: Callable[[Key], None]) -> None:
        """Calls on_link(key) for every cached key now and whenever one
        enters the cache, on_unlink(key) when one leaves it (what `lookup`
        and `contains` answer), synchronously, in order, before the call
        that linked or unlinked it returns (under the owner's lock)."""
