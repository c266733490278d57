"""Restorer: a cached prefix read into layer buffers, before prefill (the
connector's half that runs in `cache_for`, in the caller's thread). It is
given the caches, the layout and the connector's CallGuard when it is made,
and answers a Restored value that the UCMCache adopts.

Every layer gets buffers `[batch, kv_heads, prompt + DECODE_ROOM, head_dim]`
(layers.SpareLayer): the restored positions first, then room, so the
prefill of the prompt's rest and the decode steps after it write in place
instead of concatenating the restored prefix into new tensors.

Where the bytes come from, per row:

- the hbm front (front.py) for the blocks it holds, then the shared cache
  by `load` into a payload buffer (on an accelerator, or with a front:
  the blocks are promoted into the front);
- otherwise (CPU, no front), straight out of the shared cache's slots, with
  one native copy per layer and K/V for all blocks (`kv_copy.
  spans_into_layers`): streamed (`LayerStreams.stream_slots`, every layer's
  reads in flight at once) when the cache streams, so that blocks staged
  from NVMe are copied layer by layer while later layers are still being
  read; else by `read_slots` once every block is in the landing tier.
  For `TransformersConnector.generate`, only layer 0 is copied here and the
  rest inside the prefill, layer l just before attention l reads it
  (DeferredLayers), so NVMe reads overlap the model's compute.

A block counts only when every layer of it landed and the cache reports it
DONE; the restored length ends before the first block that did not (a
shorter hit). Any exception is a fault: logged, and the prefix recomputed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ucm.api import CacheAPI, Outcome
from ucm.connectors.transformers.guard import CallGuard
from ucm.connectors.transformers.kv_copy import byte_view, scatter_blocks, spans_into_layers
from ucm.connectors.transformers.layers import DECODE_ROOM
from ucm.connectors.transformers.namespace import BlockLayout
from ucm.connectors.transformers.prompt_rows import PromptRow
from ucm.layer_stream import LayerStreams


@dataclass(frozen=True, slots=True, eq=False)
class Restored:
    """A restored prefix, for `UCMCache.adopt`: per layer, key and value
    buffers `[batch, kv_heads, capacity, head_dim]` whose first `length`
    positions are filled (padding included), and the DeferredLayers whose
    later layers the first forward lands (`generate` only)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    blocks: int  # blocks restored, over every row
    deferred: list["DeferredLayers"]


class Restorer:
    """The restore path of one connector (module docstring)."""

    def __init__(self, layout: BlockLayout, *, cache: CacheAPI, front: Optional[CacheAPI], device: torch.device,
                 dtype: torch.dtype, timeout_s: float, guard: CallGuard) -> None:
        """`cache`: the shared cache; `front`: the hbm front before it, or
        None; `device` / `dtype`: the model's; `timeout_s`: the longest a
        load is waited for; `guard`: the connector's calls and counters."""
        self.layout = layout
        self.timeout_s = timeout_s
        self.guard = guard
        self._cache, self._front = cache, front
        self._device, self._dtype = device, dtype
        self._streams = isinstance(cache, LayerStreams)

    def restore(self, rows: list[PromptRow], front_hits: list[int], target: int, prompt_len: int,
                defer: bool = False) -> Optional[Restored]:
        """Reads the first `target` positions of `rows` (a prompt of
        `prompt_len` positions) into new layer buffers; the length actually
        restored is shorter where blocks did not come back. None when
        nothing was (a fault, or no block). `defer`: streamed layers after
        the first are left to the first forward (`Restored.deferred`)."""
        deferred: Optional[list] = [] if defer else None
        lay, bt = self.layout, self.layout.block_tokens
        cap = max(target, prompt_len) + DECODE_ROOM
        shape = (len(rows), lay.num_kv_heads, cap, lay.head_dim)
        try:
            ks = [torch.empty(shape, dtype=self._dtype, device=self._device) for _ in range(lay.num_layers)]
            vs = [torch.empty(shape, dtype=self._dtype, device=self._device) for _ in range(lay.num_layers)]
            for b, r in enumerate(rows):  # padding as zeros (masked; never NaN); the rest is filled or cut off
                if r.pad:
                    for t in (*ks, *vs):
                        t[b, :, :min(r.pad, target)].zero_()
            delivered = []  # per row: real tokens restored
            for b, r in enumerate(rows):
                want = max(0, target - r.pad)
                need = -(-want // bt)
                got = self._restore_row(r, b, front_hits[b], need, want, ks, vs, deferred) if need else 0
                delivered.append(min(want, got * bt))
            if self._device.type != "cpu":
                torch.cuda.current_stream(self._device).synchronize()
        except Exception:
            self.guard.fault("restore", "ucm: restoring a prefix failed; it is recomputed")
            for d in deferred or ():
                d.release()
            return None
        length = min(target, min(r.pad + d if r.valid else 0 for r, d in zip(rows, delivered)))
        if length <= 0:
            for d in deferred or ():
                d.release()
            return None
        return Restored(ks, vs, length, sum(-(-max(0, length - r.pad) // bt) for r in rows), deferred or [])

    def _restore_row(self, r: PromptRow, b: int, front_hit: int, need: int, want: int, ks: list, vs: list,
                     deferred: Optional[list]) -> int:
        """Copies blocks [0, need) of row `r` into row `b` of the layers (the
        first `want` tokens); returns how many consecutive blocks came."""
        front = self._front
        got = 0
        n_front = min(front_hit, need)
        if n_front:
            got = self._load_into(front, r, 0, n_front, b, want, ks, vs, promote=False)
            self.guard.count("front_hit_blocks", got)
            if got < n_front:
                return got
        if got < need:
            if front is None and self._device.type == "cpu":
                got += self._read_into(r, got, need, b, want, ks, vs, deferred)
            else:
                got += self._load_into(self._cache, r, got, need, b, want, ks, vs, promote=front is not None)
        self.guard.count("load_failed_blocks", need - got)
        return got

    # ---- CPU, no front: straight out of the cache's slots -----------------------
    def spans(self, slots: list, r: PromptRow, first: int, want: int) -> list[tuple[int, int, int]]:
        """The (slot offset, first position, tokens) of row `r`'s blocks from
        block `first` on, held in `slots`, its first `want` tokens only."""
        bt = self.layout.block_tokens
        return [(slot[0], r.pad + (first + i) * bt, min(bt, want - (first + i) * bt)) for i, slot in enumerate(slots)]

    def _read_into(self, r: PromptRow, first: int, last: int, b: int, want: int, ks: list, vs: list,
                   deferred: Optional[list]) -> int:
        """Blocks [first, last) of row `r` from the cache's slots into the
        layers; returns the consecutive blocks copied."""
        kb, vb = [byte_view(k) for k in ks], [byte_view(v) for v in vs]
        cap, item = ks[0].shape[2], ks[0].element_size()
        if self._streams:
            return self._stream_into(r, first, last, b, want, kb, vb, cap, item, deferred)
        return self._slots_into(r, first, last, b, want, kb, vb, cap, item)

    def _slots_into(self, r: PromptRow, first: int, last: int, b: int, want: int, kb: list, vb: list, cap: int,
                    item: int) -> int:
        """`_read_into` by `read_slots`: every layer of the blocks at once, in
        the parts the cache or its client cuts the call into."""
        lay = self.layout
        copied = [False] * (last - first)

        def fill(start: int, slots: list, arena: Any) -> None:
            held = [(i, s) for i, s in enumerate(slots) if s is not None]
            spans = [(s[0], r.pad + (first + start + i) * lay.block_tokens,
                      min(lay.block_tokens, want - (first + start + i) * lay.block_tokens)) for i, s in held]
            spans_into_layers(arena, spans, lay.shape, item, kb, vb, b, cap, range(lay.num_layers))
            for i, _ in held:
                copied[start + i] = True

        keys = r.keys[first:last]
        out = self.guard.call("read_slots", lambda: self._cache.read_slots(
            keys, [lay.block_bytes] * len(keys), fill, request_id=r.request_id), default=None)
        if out is None:
            return 0
        n = 0
        while n < len(out) and out[n] is Outcome.DONE and copied[n]:
            n += 1
        return n

    def _stream_into(self, r: PromptRow, first: int, last: int, b: int, want: int, kb: list, vb: list, cap: int,
                     item: int, deferred: Optional[list]) -> int:
        """`_read_into` by a streamed load: layer l of the blocks landed so far
        is copied as soon as it is in its slot (blocks in DRAM at once,
        blocks below it as they are read). With `deferred` (a list), only
        layer 0 is copied here and the stream goes into the list."""
        lay = self.layout
        keys = r.keys[first:last]
        st = self.guard.call("stream_slots", lambda: self._cache.stream_slots(
            keys, [lay.block_bytes] * len(keys), lay.num_layers, request_id=r.request_id), default=None)
        if st is None:
            return 0
        d = DeferredLayers(self, st, r, first, want, b, kb, vb, cap, item)
        kept = False
        try:
            ok = d.copy(0, len(keys))
            if ok < len(keys) and list(st.slots)[ok] is None:
                # No slot for block `ok`: a hit longer than the landing tier holds at once (a stream
                # stages every block before any is released). Read it in parts instead.
                d.release()
                return self._slots_into(r, first, last, b, want, kb, vb, cap, item)
            if ok and deferred is not None and lay.num_layers > 1:
                d.claimed = ok
                deferred.append(d)
                kept = True
                return ok
            for layer in range(1, lay.num_layers):
                if not ok:
                    break
                ok = d.copy(layer, ok)
            return d.done(ok) if ok else 0
        finally:
            if not kept:
                d.release()

    # ---- an accelerator, or the hbm front: through a payload buffer --------------
    def _load_into(self, source: Optional[CacheAPI], r: PromptRow, first: int, last: int, b: int, want: int,
                   ks: list, vs: list, promote: bool) -> int:
        """Blocks [first, last) of row `r` loaded from `source` into a
        payload buffer (on the device for the hbm front, else host memory),
        then into the layers; with `promote`, also stored into the front."""
        lay, bt, device = self.layout, self.layout.block_tokens, self._device
        n = last - first
        on_device = source is self._front
        dev = device if on_device else torch.device("cpu")
        payload = torch.empty((n, *lay.shape), dtype=self._dtype, device=dev,
                              pin_memory=(dev.type == "cpu" and device.type == "cuda"))
        keys = r.keys[first:last]
        handle = self.guard.call("load", lambda: source.load(keys, [payload[i] for i in range(n)],
                                                             request_id=r.request_id), default=None)
        out = handle.wait(self.timeout_s) if handle is not None else None
        if out is None:
            if handle is not None:
                self.guard.warn_once("load-timeout", f"ucm: a load took longer than {self.timeout_s:g} s; recomputed")
            return 0
        got = 0
        while got < n and out[got] is Outcome.DONE:
            got += 1
        if not got:
            return 0
        src = payload[:got].to(device, non_blocking=True) if dev != device else payload[:got]
        tokens = min(got * bt, want - first * bt)
        scatter_blocks(src, ks, vs, b, r.pad + first * bt, tokens)
        front = self._front
        if promote and front is not None:
            parent = r.keys[first - 1] if first else None
            self.guard.call("store", lambda: front.store(keys[:got], [src[i] for i in range(got)], parent=parent,
                                                         request_id=r.request_id))
        return got


class RestoreFault(Exception):
    """A deferred layer of a restored prefix did not land: raised inside the
    first forward and caught by `TransformersConnector.generate`, which
    recomputes the prompt (never seen by the caller)."""


class DeferredLayers:
    """One row's streamed load whose layers are copied as they are needed.

    `cache_for` copies layer 0 and claims the blocks that landed
    (`claimed`); the first forward copies layer l just before attention l
    reads it (`UCMCache.update` -> `land`), so that blocks read from NVMe
    are copied while the model already computes the layers below, and
    checks after the last layer that every claimed block is DONE. A claimed
    block that fails later cannot be taken back from a forward under way:
    `land` raises RestoreFault and the connector's `generate` recomputes.
    Only `TransformersConnector.generate` defers (a cache given by the
    caller to `model.generate` restores every layer in `cache_for`)."""

    def __init__(self, restorer: Restorer, st: Any, r: PromptRow, first: int, want: int, b: int, kb: list, vb: list,
                 cap: int, item: int) -> None:
        self.restorer, self.st, self.r, self.first, self.want, self.b = restorer, st, r, first, want, b
        self.kb, self.vb, self.cap, self.item = kb, vb, cap, item
        self.deadline = time.monotonic() + restorer.timeout_s
        self.claimed = 0
        self._released = False

    def copy(self, layer: int, ok: int) -> int:
        """Waits for `layer` of the first `ok` blocks and copies it for the
        leading blocks that landed; returns how many those are."""
        lay = self.restorer.layout
        st = self.st
        landed = st.wait_layer(layer, max(0.0, self.deadline - time.monotonic()))
        slots = list(st.slots)  # known once a block's layer landed (a scratch stream publishes them late)
        n = 0
        while n < ok and landed[n] and slots[n] is not None and slots[n][1] == lay.block_bytes:
            n += 1
        if n:
            spans = self.restorer.spans(slots[:n], self.r, self.first, self.want)
            spans_into_layers(st.arena, spans, lay.shape, self.item, self.kb, self.vb, self.b, self.cap, (layer,))
        return n

    def done(self, ok: int) -> int:
        """Of the first `ok` blocks, how many leading ones the cache reports
        DONE once the stream is finished."""
        out = self.st.outcomes(max(0.0, self.deadline - time.monotonic()))
        n = 0
        while n < ok and out[n] is Outcome.DONE:
            n += 1
        if n < ok and time.monotonic() >= self.deadline:
            timeout_s = self.restorer.timeout_s
            self.restorer.guard.warn_once("load-timeout", f"ucm: a load took longer than {timeout_s:g} s; recomputed")
        return n

    def land(self, layer: int, last: bool) -> None:
        """Layer `layer` of the claimed blocks into the layers (raises
        RestoreFault when one did not land); after the `last` layer, the
        check that every claimed block is DONE, and the stream's release."""
        if layer and self.copy(layer, self.claimed) < self.claimed:
            raise RestoreFault(f"layer {layer} of a restored block did not land")
        if last:
            ok = self.done(self.claimed)
            self.release()
            if ok < self.claimed:
                raise RestoreFault("a restored block was not DONE")

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.restorer.guard.call("release", self.st.release)
