"""What a cache holds, as the KV events an engine publishes to routers.

`TierEventReader` follows a cache's block catalog (ucm.cache.catalog:
`events`, and `holdings` after a reset) from a thread of its own, and keeps
per block what the engine's consumers were last told (`sent`, a medium)
and what is true now (`medium`). `take()` answers the difference, parents
before children: a block that entered a tier is stored with that tier's
medium; one that moved is removed from the old medium and stored with the
new one; one that left every tier is removed. Between two takes changes
coalesce (a block stored and removed again is never told), so what waits
is bounded by the blocks themselves, and a slow consumer never blocks the
poll nor the poll the consumer.

A described block is advertised only when its key is the chain key of its
tokens behind its parent (the key the engine would compute: another
namespace's blocks fail the check) and its parent is advertised, since a
hit needs the whole prefix; a block whose parent is not (yet) known waits
among the orphans. The engine's block hashes are computed by `hash_pages`
from the tokens, so a block another engine stored gets this engine's
hashes. When the cache cannot be reached, or comes back as another
instance, every block is withdrawn until the new holdings are read: a
removal, never a stale claim.

Engine-neutral; ucm.connectors.vllm.kv_events makes vLLM's events of it.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from ucm.api import Key
from ucm.keys import block_keys

log = logging.getLogger(__name__)

__all__ = ["TierEventReader", "Stored", "Removed", "HashPages"]

# hash_pages(parent page hash or None, the block's tokens, its extra, whether it is the prompt's first block)
# -> the engine's hash of each page of the block
HashPages = Callable[[Optional[Any], np.ndarray, Optional[dict], bool], list]


class Stored(NamedTuple):
    hashes: list  # the engine's hashes of the block's pages
    parent_hash: Optional[Any]  # of the page before the block; None for a prompt's first block
    tokens: np.ndarray
    extra: Optional[dict]
    medium: str


class Removed(NamedTuple):
    hashes: list
    medium: str


class _Block:
    __slots__ = ("key", "parent", "tokens", "extra", "hashes", "depth", "medium", "sent")

    def __init__(self, key: Key, parent: Optional[Key], tokens: np.ndarray, extra: Optional[dict],
                 hashes: list, depth: int) -> None:
        self.key, self.parent, self.tokens, self.extra = key, parent, tokens, extra
        self.hashes, self.depth = hashes, depth
        self.medium: Optional[str] = None  # where ucm holds it now
        self.sent: Optional[str] = None  # what the consumers were told


class TierEventReader:
    """One engine's view of one cache's blocks; see the module docstring."""

    def __init__(self, cache: Any, seed_for: Callable[[Optional[dict]], Key], block_tokens: int,
                 hash_pages: HashPages, *, poll_s: float = 0.1, page: int = 256, max_orphans: int = 4096,
                 threaded: bool = True) -> None:
        """`seed_for(extra)`: the key seed of a prompt's first block with
        that request context (the engine's namespace, salted). `threaded`
        False: no poll thread, the owner calls `poll`."""
        self.cache = cache
        self.seed_for = seed_for
        self.block_tokens = block_tokens
        self.hash_pages = hash_pages
        self.poll_s = poll_s
        self.page = page
        self.max_orphans = max_orphans
        self.threaded = threaded
        self.epoch: Optional[int] = None
        self.next = 0
        self.counts = {"polls": 0, "resets": 0, "unreachable": 0, "foreign": 0, "orphans_dropped": 0}
        self._lock = threading.Lock()
        self._blocks: dict[Key, _Block] = {}
        self._children: dict[Key, set] = {}
        self._orphans: OrderedDict[Key, list] = OrderedDict()  # key -> its stored row, until its parent comes
        self._waiting: dict[Key, set] = {}  # parent -> its orphans
        self._changed: set = set()  # keys whose medium differs from what was sent
        self._gone: dict[Key, _Block] = {}  # withdrawn blocks the consumers were told of
        self._describe: list = []  # descriptions to send from the poll thread
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- the engine's side ---------------------------------------------------------
    def describe(self, blocks: list) -> None:
        """Blocks the engine stores ([key, parent, tokens, extra]); sent to
        the cache by the poll thread."""
        with self._lock:
            self._describe.extend(blocks)
            del self._describe[:-65536]  # bounded: the oldest descriptions go first

    def take(self) -> list:
        """The changes since the last take (Removed and Stored, removals
        first, then stores parents first). Starts the poll thread."""
        if self._thread is None and self.threaded:
            self._thread = threading.Thread(target=self._run, name="ucm-kv-events", daemon=True)
            self._thread.start()
        with self._lock:
            out: list = [Removed(b.hashes, b.sent) for b in self._gone.values()]
            self._gone.clear()
            stores = []
            for key in self._changed:
                b = self._blocks.get(key)
                if b is None or b.medium == b.sent:
                    continue
                if b.sent is not None:
                    out.append(Removed(b.hashes, b.sent))
                if b.medium is not None:
                    stores.append(b)
                b.sent = b.medium
            self._changed.clear()
            stores.sort(key=lambda b: b.depth)
            for b in stores:
                p = self._blocks.get(b.parent) if b.parent is not None else None
                out.append(Stored(b.hashes, p.hashes[-1] if p is not None else None, b.tokens, b.extra, b.medium))
            return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def stats(self) -> dict:
        with self._lock:
            return {"advertised": sum(1 for b in self._blocks.values() if b.medium), "orphans": len(self._orphans),
                    "epoch": self.epoch, "next": self.next, **self.counts}

    # ---- the poll thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:  # never into the engine: the next poll starts over
                log.warning("ucm KV events: a poll failed", exc_info=True)
                with self._lock:
                    self._withdraw_all()
            self._stop.wait(self.poll_s)

    def poll(self) -> None:
        """Sends the waiting descriptions and reads the catalog's changes."""
        with self._lock:
            todo, self._describe = self._describe, []
        if todo:
            self.cache.describe(todo)
        self.counts["polls"] += 1
        while True:
            r = self.cache.events(self.next, self.epoch, self.page)
            if not r.get("available", True):
                self.counts["unreachable"] += 1
                with self._lock:
                    self._withdraw_all()
                return
            if r["reset"]:
                self._resync(r["epoch"], r["next"])
                continue
            with self._lock:
                for row in r["events"]:
                    self._apply(row)
                self.next = r["next"]
            if len(r["events"]) < self.page:
                return

    def _resync(self, epoch: int, nxt: int) -> None:
        """Reads the holdings of the cache's current journal; what they lack is withdrawn."""
        self.counts["resets"] += 1
        rows, offset = [], 0
        while True:
            h = self.cache.holdings(offset, self.page)
            if not h.get("available", True):
                raise ConnectionError("the cache went away while its holdings were read")
            rows.extend(h["blocks"])
            offset = h["next_offset"]
            if h["done"] or not h["blocks"]:
                break
        with self._lock:
            held = {row[2] for row in rows}
            for key in [k for k in self._blocks if k not in held]:
                self._remove(key)
            self._orphans.clear()
            self._waiting.clear()
            for row in rows:
                self._apply(row)
            self.epoch, self.next = epoch, nxt

    # ---- the state (under the lock) ----------------------------------------------------
    def _withdraw_all(self) -> None:
        for key in list(self._blocks):
            self._remove(key)
        self._orphans.clear()
        self._waiting.clear()
        self.epoch, self.next = None, 0

    def _orphan(self, key: Key, row: list) -> None:
        self._unorphan(key)
        self._orphans[key] = row
        self._waiting.setdefault(row[4], set()).add(key)
        while len(self._orphans) > self.max_orphans:
            self._unorphan(next(iter(self._orphans)))
            self.counts["orphans_dropped"] += 1

    def _unorphan(self, key: Key) -> Optional[list]:
        row = self._orphans.pop(key, None)
        if row is not None:
            kids = self._waiting.get(row[4])
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._waiting[row[4]]
        return row

    def _apply(self, row: list) -> None:
        todo = [row]
        while todo:
            row = todo.pop()
            _, kind, key, medium, parent, tokens, extra = row
            if kind == "removed":
                self._unorphan(key)
                self._remove(key)
                continue
            b = self._blocks.get(key)
            if b is None:
                b = self._adopt(row)
                if b is None:
                    continue
            if b.medium != medium:
                b.medium = medium
                self._changed.add(key)
            for child in list(self._waiting.get(key, ())):
                todo.append(self._unorphan(child))

    def _adopt(self, row: list) -> Optional[_Block]:
        """A newly seen block: checked, hashed and linked to its parent; None
        when it is foreign or waits for its parent."""
        _, _, key, _, parent, tokens, extra = row
        toks = np.frombuffer(tokens, dtype="<u4")
        if len(toks) != self.block_tokens:
            self.counts["foreign"] += 1
            return None
        try:
            seed = self.seed_for(extra) if parent is None else parent
            if block_keys(seed, toks, self.block_tokens)[0] != key:
                self.counts["foreign"] += 1
                return None
        except Exception:
            self.counts["foreign"] += 1
            return None
        p = self._blocks.get(parent) if parent is not None else None
        if parent is not None and (p is None or p.medium is None):
            self._orphan(key, row)
            return None
        hashes = self.hash_pages(p.hashes[-1] if p is not None else None, toks, extra, parent is None)
        b = self._blocks[key] = _Block(key, parent, toks, extra, hashes, 0 if p is None else p.depth + 1)
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        return b

    def _remove(self, key: Key) -> None:
        """Withdraws `key` and the blocks behind it (a hit needs its whole
        prefix); those still held wait among the orphans for it to come back."""
        todo = [key]
        while todo:
            k = todo.pop()
            b = self._blocks.pop(k, None)
            if b is None:
                continue
            if b.sent is not None:
                self._gone[k] = b
            self._changed.discard(k)
            kids = self._children.pop(k, ())
            if b.parent is not None and b.parent in self._children:
                self._children[b.parent].discard(k)
            for c in kids:
                cb = self._blocks.get(c)
                if cb is not None and cb.medium is not None:
                    self._orphan(c, [0, "stored", c, cb.medium, k, cb.tokens.tobytes(), cb.extra])
                todo.append(c)
