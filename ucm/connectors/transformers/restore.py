"""Restoring a cached prefix into a UCMCache's layers, before prefill (the
connector's half that runs in `cache_for`, in the caller's thread).

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
from typing import TYPE_CHECKING, Any, Optional

import torch

from ucm.api import CacheAPI, Outcome
from ucm.connectors.transformers.kv_copy import byte_view, scatter_blocks, spans_into_layers
from ucm.connectors.transformers.layers import DECODE_ROOM
from ucm.layer_stream import LayerStreams

if TYPE_CHECKING:
    from ucm.connectors.transformers.connector import TransformersConnector, UCMCache, _Row


class Restorer:
    """The restore path of one connector (its layout, caches and counters)."""

    def __init__(self, conn: "TransformersConnector") -> None:
        self.conn = conn
        self.layout = conn.layout
        self._streams = isinstance(conn._cache, LayerStreams)

    def restore(self, cache: "UCMCache", rows: list["_Row"], front_hits: list[int], target: int,
                defer: bool = False) -> int:
        """Fills the layers of `cache` with the first `target` positions;
        returns the length actually restored (shorter where blocks did not
        come back; 0 on a fault). `defer`: streamed layers after the first
        are left to the first forward (`cache._deferred`, see DeferredLayers)."""
        deferred: Optional[list] = [] if defer else None
        conn, lay, bt = self.conn, self.layout, self.layout.block_tokens
        cap = max(target, cache.prompt_len) + DECODE_ROOM
        shape = (len(rows), lay.num_kv_heads, cap, lay.head_dim)
        try:
            ks = [torch.empty(shape, dtype=conn.dtype, device=conn.device) for _ in range(lay.num_layers)]
            vs = [torch.empty(shape, dtype=conn.dtype, device=conn.device) for _ in range(lay.num_layers)]
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
            if conn.device.type != "cpu":
                torch.cuda.current_stream(conn.device).synchronize()
        except Exception:
            conn._fault("restore", "ucm: restoring a prefix failed; it is recomputed")
            for d in deferred or ():
                d.release()
            return 0
        length = min(target, min(r.pad + d if r.valid else 0 for r, d in zip(rows, delivered)))
        if length <= 0:
            for d in deferred or ():
                d.release()
            return 0
        cache._deferred = deferred or []
        for layer, k, v in zip(cache.layers, ks, vs):
            layer.adopt(k, v, length)
        cache.restored_tokens = length
        cache.restored_blocks = sum(-(-max(0, length - r.pad) // bt) for r in rows)
        return length

    def _restore_row(self, r: "_Row", b: int, front_hit: int, need: int, want: int, ks: list, vs: list,
                     deferred: Optional[list]) -> int:
        """Copies blocks [0, need) of row `r` into row `b` of the layers (the
        first `want` tokens); returns how many consecutive blocks came."""
        conn = self.conn
        got = 0
        n_front = min(front_hit, need)
        if n_front:
            got = self._load_into(conn.front, r, 0, n_front, b, want, ks, vs, promote=False)
            conn._count("front_hit_blocks", got)
            if got < n_front:
                return got
        if got < need:
            if conn.front is None and conn.device.type == "cpu":
                got += self._read_into(r, got, need, b, want, ks, vs, deferred)
            else:
                got += self._load_into(conn._cache, r, got, need, b, want, ks, vs, promote=conn.front is not None)
        conn._count("load_failed_blocks", need - got)
        return got

    # ---- CPU, no front: straight out of the cache's slots -----------------------
    def _spans(self, slots: list, r: "_Row", first: int, want: int) -> list[tuple[int, int, int]]:
        bt = self.layout.block_tokens
        return [(slot[0], r.pad + (first + i) * bt, min(bt, want - (first + i) * bt)) for i, slot in enumerate(slots)]

    def _read_into(self, r: "_Row", first: int, last: int, b: int, want: int, ks: list, vs: list,
                   deferred: Optional[list]) -> int:
        """Blocks [first, last) of row `r` from the cache's slots into the
        layers; returns the consecutive blocks copied."""
        kb, vb = [byte_view(k) for k in ks], [byte_view(v) for v in vs]
        cap, item = ks[0].shape[2], ks[0].element_size()
        if self._streams:
            return self._stream_into(r, first, last, b, want, kb, vb, cap, item, deferred)
        return self._slots_into(r, first, last, b, want, kb, vb, cap, item)

    def _slots_into(self, r: "_Row", first: int, last: int, b: int, want: int, kb: list, vb: list, cap: int,
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
        out = self.conn._call("read_slots", lambda: self.conn._cache.read_slots(
            keys, [lay.block_bytes] * len(keys), fill, request_id=r.request_id), default=None)
        if out is None:
            return 0
        n = 0
        while n < len(out) and out[n] is Outcome.DONE and copied[n]:
            n += 1
        return n

    def _stream_into(self, r: "_Row", first: int, last: int, b: int, want: int, kb: list, vb: list, cap: int,
                     item: int, deferred: Optional[list]) -> int:
        """`_read_into` by a streamed load: layer l of the blocks landed so far
        is copied as soon as it is in its slot (blocks in DRAM at once,
        blocks below it as they are read). With `deferred` (a list), only
        layer 0 is copied here and the stream goes into the list."""
        conn, lay = self.conn, self.layout
        keys = r.keys[first:last]
        st = conn._call("stream_slots", lambda: conn._cache.stream_slots(
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
    def _load_into(self, source: Optional[CacheAPI], r: "_Row", first: int, last: int, b: int, want: int,
                   ks: list, vs: list, promote: bool) -> int:
        """Blocks [first, last) of row `r` loaded from `source` into a
        payload buffer (on the device for the hbm front, else host memory),
        then into the layers; with `promote`, also stored into the front."""
        conn, lay, bt = self.conn, self.layout, self.layout.block_tokens
        n = last - first
        on_device = source is conn.front
        dev = conn.device if on_device else torch.device("cpu")
        payload = torch.empty((n, *lay.shape), dtype=conn.dtype, device=dev,
                              pin_memory=(dev.type == "cpu" and conn.device.type == "cuda"))
        keys = r.keys[first:last]
        handle = conn._call("load", lambda: source.load(keys, [payload[i] for i in range(n)],
                                                        request_id=r.request_id), default=None)
        out = handle.wait(conn._timeout_s) if handle is not None else None
        if out is None:
            if handle is not None:
                conn._warn_once("load-timeout", f"ucm: a load took longer than {conn._timeout_s:g} s; recomputed")
            return 0
        got = 0
        while got < n and out[got] is Outcome.DONE:
            got += 1
        if not got:
            return 0
        src = payload[:got].to(conn.device, non_blocking=True) if dev != conn.device else payload[:got]
        tokens = min(got * bt, want - first * bt)
        scatter_blocks(src, ks, vs, b, r.pad + first * bt, tokens)
        if promote and conn.front is not None:
            parent = r.keys[first - 1] if first else None
            conn._call("store", lambda: conn.front.store(keys[:got], [src[i] for i in range(got)], parent=parent,
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

    def __init__(self, restorer: Restorer, st: Any, r: "_Row", first: int, want: int, b: int, kb: list, vb: list,
                 cap: int, item: int) -> None:
        self.restorer, self.st, self.r, self.first, self.want, self.b = restorer, st, r, first, want, b
        self.kb, self.vb, self.cap, self.item = kb, vb, cap, item
        self.deadline = time.monotonic() + restorer.conn._timeout_s
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
            spans = self.restorer._spans(slots[:n], self.r, self.first, self.want)
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
            conn = self.restorer.conn
            conn._warn_once("load-timeout", f"ucm: a load took longer than {conn._timeout_s:g} s; recomputed")
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
            self.restorer.conn._call("release", self.st.release)
