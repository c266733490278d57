"""FakeCache: an in-memory `ucm.api.CacheAPI` for the connector's unit
tests, with what they need to observe and to break it.

- Blocks live in `tiers` (key -> tier name) and, when they have bytes, in
  `slots` (key -> (offset, length) in the bytearray `arena`).
- Pins are counted per key and may never go below zero.
- `events` records the request events in order: ("begin", request_id,
  n_keys), ("finish", request_id, n_keys, output_tokens); `slot_calls` the
  request id of every read_slots / write_slots call.
- `write_slots` keeps the reserve / fill / commit-or-abort contract: a
  `fill` that raises stores nothing (FAILED). `reserve_gate`, when an
  Event, holds write_slots before its fill after setting `reserving`.
- `prefetches`: (keys, handle) of every prefetch, completed by `stage`.
- `lost`: keys whose bytes read back as a miss. `broken`: names of methods
  that raise RuntimeError (a cache fault at the seam).
"""
from __future__ import annotations

import threading
from collections import Counter

from ucm.api import Handle, Outcome, RangeRead

JOIN_S = 20.0


class FakeCache:
    def __init__(self):
        self.tiers, self.pins = {}, Counter()
        self.events, self.slot_calls = [], []
        self.arena = bytearray(1 << 22)
        self.slots, self.next = {}, 4096
        self.lost, self.broken = set(), set()
        self.reserve_gate = None
        self.prefetches = []  # (keys, Handle) per prefetch call, in order
        self.reserving = threading.Event()
        self.closed = False
        self.layouts = []  # KvLayouts registered, in order
        self.described = []  # block descriptions (describe), in order

    def _check(self, name):
        if name in self.broken:
            raise RuntimeError(f"injected fault in {name}")

    # ---- control ----------------------------------------------------------------
    def lookup(self, keys):
        self._check("lookup")
        n = 0
        while n < len(keys) and keys[n] in self.tiers:
            n += 1
        return n

    def locate(self, keys):
        self._check("locate")
        return [self.tiers.get(k) for k in keys]

    def register_layout(self, layout):
        self._check("register_layout")
        self.layouts.append(layout)

    def begin_request(self, request_id, keys, parent=None):
        self._check("begin_request")
        self.events.append(("begin", request_id, len(keys)))

    def pin(self, keys):
        self._check("pin")
        self.pins.update(k for k in keys if k in self.tiers)

    def unpin(self, keys):
        self._check("unpin")
        for k in keys:
            assert self.pins[k] > 0, "unpinned a block that was not pinned"
            self.pins[k] -= 1
        self.pins += Counter()

    def pinned(self):
        return sum(self.pins.values())

    def finish(self, keys, output_tokens, request_id=None):
        self._check("finish")
        self.events.append(("finish", request_id, len(keys), output_tokens))

    # ---- the slot API -------------------------------------------------------------
    def write_slots(self, keys, sizes, fill, parent=None, request_id=None):
        self._check("write_slots")
        self.slot_calls.append(("write", request_id))
        self.reserving.set()
        if self.reserve_gate is not None:
            assert self.reserve_gate.wait(JOIN_S)
        slots = []
        for k, n in zip(keys, sizes):
            if k in self.slots:
                slots.append(None)  # cached already
                continue
            slots.append((self.next, n))
            self.next += n + 4096
        try:
            fill(0, slots, self.arena)
        except Exception:
            return [Outcome.FAILED] * len(keys)  # aborted: nothing committed
        for k, s in zip(keys, slots):
            if s is not None:
                self.slots[k] = s
                self.tiers[k] = "dram"
        return [Outcome.DONE] * len(keys)

    def read_slots(self, keys, sizes, fill, request_id=None):
        self._check("read_slots")
        self.slot_calls.append(("read", request_id))
        slots = [self.slots.get(k) if k not in self.lost else None for k in keys]
        try:
            fill(0, slots, self.arena)
        except Exception:
            return [Outcome.FAILED] * len(keys)
        return [Outcome.DONE if s else Outcome.MISSING for s in slots]

    def read_ranges(self, keys, offsets, dsts, request_id=None):
        self._check("read_ranges")
        out = []
        for k, offs, ds in zip(keys, offsets, dsts):
            slot = self.slots.get(k) if k not in self.lost else None
            if slot is None:
                out.append(RangeRead(Outcome.MISSING))
                continue
            off, n = slot
            if any(o + len(d) > n for o, d in zip(offs, ds)):
                out.append(RangeRead(Outcome.CORRUPT, self.tiers.get(k)))
                continue
            for o, d in zip(offs, ds):
                memoryview(d).cast("B")[:] = self.arena[off + o:off + o + len(d)]
            out.append(RangeRead(Outcome.DONE, self.tiers.get(k), sum(len(d) for d in ds)))
        return out

    def blob(self, k):
        off, n = self.slots[k]
        return bytes(self.arena[off:off + n])

    # ---- the rest of CacheAPI (unused by the connector) ------------------------------
    def store(self, keys, srcs, parent=None, request_id=None):
        h = Handle(len(keys))
        h.resolve([Outcome.FAILED] * len(keys))
        return h

    def load(self, keys, dsts, request_id=None):
        return self.store(keys, dsts)

    def prefetch(self, keys, tier=None):
        """Staging the test completes: `stage(i)` moves the i-th prefetch's
        keys to "dram" (those not in `refuse`) and resolves its handle."""
        self._check("prefetch")
        h = Handle(len(keys))
        self.prefetches.append((list(keys), h))
        return h

    def stage(self, i=-1, refuse=()):
        keys, h = self.prefetches[i]
        out = []
        for k in keys:
            if k in self.tiers and k not in refuse:
                self.tiers[k] = "dram"
                out.append(Outcome.DONE)
            else:
                out.append(Outcome.MISSING)
        h.resolve(out)

    # The block catalog: descriptions are recorded; no changes are ever journaled.
    def describe(self, blocks):
        self._check("describe")
        self.described.extend(blocks)

    def events(self, since, epoch, limit=256):
        self._check("events")
        return {"epoch": 1, "next": 0, "events": [], "reset": epoch != 1}

    def holdings(self, offset, limit=256):
        self._check("holdings")
        return {"blocks": [], "next_offset": 0, "done": True}

    def stats(self):
        return {}

    def flush(self, timeout_s=60.0):
        return True

    def close(self):
        self.closed = True
