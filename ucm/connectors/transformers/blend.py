"""ChunkBlender: `generate()` over a prompt whose chunks (retrieved
passages) are reused from ucm wherever they sit, with a share of their
tokens recomputed (the `blend` accelerator's options,
ucm/accelerators/blend.py).

    out = connector.generate(input_ids, chunks=[(s0, e0), (s1, e1)], max_new_tokens=32)
    # or: ChunkBlender(connector).generate(...); prefill(...) answers the blended cache

Chunks as entries. A chunk's KV is computed after the prompt's tokens
before its first chunk (the system prompt; `context: prefix`, the default)
or alone at position 0 (`context: none`), and stored as the full blocks of
its tokens in a namespace of its own: the connector's (model, dtype,
layout, salt) with a layout that also names the model's RoPE
(`ucm.connectors.rope`: pairing and every frequency) and what the chunk was
computed after (the prefix's length, which is the position it was computed
at, and a digest of its tokens). Another base, scaling, model or prefix is
another namespace, so never a hit. One lookup per chunk finds how many of
its blocks are cached; a chunk not wholly cached is computed (one forward
of its tokens, over the prefix's KV) and its missing blocks stored. A load
that fails, times out or finds a block corrupt (the tier's checksum) is a
miss: the chunk is computed; never bytes of another chunk. The tokens
before the first chunk (the system prompt) are one more chunk, at position
0, which is exact. Computed after the system prompt, a chunk's first tokens
do not take the attention a sequence's first token draws (the sink): on
`ucm bench blend`'s prompts this nearly halves naive concatenation's KL to
the full prefill (docs/results.md).

Blend. The prompt's tokens but its last become a DynamicCache that
`generate` continues from (it computes the last token, whose logits are
the first answer token's). Per layer, the cache holds each chunk's K
rotated from where it was computed to its positions and its V unchanged.
Tokens without a reused entry (between chunks, after a chunk's last whole
block, the question after the last chunk) are computed in every layer, in
the same pass as the recomputed ones. Of the reused chunk tokens (not the
system prompt's), a share is recomputed (`select`, `ratio`,
`leading_tokens`, `check_layers`, `question_from_layer`):
- `deviation`: layers 0..check_layers-1 are computed for every token after
  the system prompt; at layer `check_layers`, each reused token's fresh K/V
  (projected by the model's own layer) is compared with its reused K/V, and
  the `ratio` that deviate most are recomputed in the remaining layers
  (ratio 0: nothing, plain concatenation; 1: the full prefill);
- `question`: the prompt's tokens after the last chunk (the question)
  run through the model's layers over the reused K/V (in one pass with
  the tokens before them no entry covers, computed as at ratio 0), their
  own K/V kept apart, with the attention's weights explicit
  (`ucm_attention_mass`, registered with transformers' AttentionInterface
  and set only while the probe runs); the `ratio` of reused chunk tokens
  they attend to most, summed over heads, question tokens and the layers
  from `question_from_layer` (the last half by default), are recomputed
  in every layer (why, and how close it comes to the full prefill:
  decision 21);
- `leading`: each chunk's first `leading_tokens`, in every layer.
A recomputed token runs through the model's own decoder layers, attending
over the layer's blended KV up to its position (the layer's cache `update`
writes its fresh K/V into the blended KV and answers the whole), so the
model's attention, norms and MLP are used as they are. Where the model's
attention is transformers' `sdpa`, the recompute calls it band by band
(`ucm_banded_sdpa`, registered with transformers' AttentionInterface and
set on the model's config only while the blend's layers run): each band of
tokens attends over the keys up to its last position, not the whole
prompt's.

Models. RoPE models whose keys `ucm.connectors.rope` can move (Llama and
its family) with the layers transformers' `model.model.layers` calls as
`layer(hidden, attention_mask=, position_ids=, past_key_values=,
position_embeddings=)`; anything else is a plain `generate` (the prompt is
prefilled in full), counted as `unsupported`. Batch size 1.

Threads: the caller's; stores run on the cache's own threads and their
sources are kept until they are done.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ucm.accelerators.blend import BlendAccelerator, BlendOptions
from ucm.api import Handle, Outcome
from ucm.connectors.blend_select import checked_layers, question_layers, select
from ucm.connectors.rope import RopeSpec, rope_of, rotate
from ucm.connectors.transformers.attention_mass import question_attention
from ucm.connectors.transformers.banded import banded_sdpa, bands
from ucm.errors import ArgumentError, ModelError
from ucm.keys import Namespace, block_keys

log = logging.getLogger(__name__)


@dataclass
class BlendReport:
    """What a blended prefill did: chunks read and computed, tokens reused
    and recomputed (in the layers after the check), the blended length (the
    prompt's tokens but its last: what the cache holds)."""

    blended_tokens: int = 0
    chunks_hit: int = 0
    chunks_computed: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    unsupported: bool = False
    chunk_blocks_loaded: int = 0
    chunk_blocks_stored: int = 0
    selected: list[int] = field(default_factory=list)  # positions recomputed in every layer
    layer_tokens: int = 0  # tokens times layers computed (a full prefill of the N tokens: N times layers)

    @property
    def recompute_share(self) -> float:
        """The tokens computed in every layer over the blended tokens."""
        return self.recomputed_tokens / self.blended_tokens if self.blended_tokens else 0.0


class _BlendKV:
    """The cache a decoder layer is called with: `update` writes the layer's
    fresh K/V of the tokens at `positions` into the blended K/V and answers
    the whole. With `probe`, it keeps the fresh K/V (and writes them where
    it has `positions`) and stops the layer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys, self.values = keys, values
        self.positions: Optional[torch.Tensor] = None
        self.probe = False
        self.caught: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.probe:
            self.caught = (k, v)
            if self.positions is not None:  # the last layer of a recompute: its K/V are all it gives
                self.keys[layer_idx][:, :, self.positions] = k
                self.values[layer_idx][:, :, self.positions] = v
            raise _Probed
        self.keys[layer_idx][:, :, self.positions] = k
        self.values[layer_idx][:, :, self.positions] = v
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.keys[layer_idx].shape[2])


class _Probed(Exception):
    """Stops a decoder layer once its K/V are projected (a probe)."""


class _Prefix:
    """The tokens chunks are computed after, and their KV, computed on the
    first `cache()` (only a chunk that misses needs it): a DynamicCache the
    caller crops back to the prefix after each chunk."""

    def __init__(self, model: Any, ids: torch.Tensor, device: torch.device) -> None:
        self.model, self.ids, self.device = model, ids.tolist(), device
        self._cache: Any = None

    def cache(self) -> Any:
        if self._cache is None:
            row = torch.tensor([self.ids], device=self.device)
            self._cache = self.model(input_ids=row, use_cache=True, logits_to_keep=1).past_key_values
        return self._cache


class ChunkBlender:
    """Blended prefills over a TransformersConnector's model and cache (see
    the module docstring)."""

    def __init__(self, connector: Any, options: Optional[BlendOptions] = None, timeout_s: float = 30.0) -> None:
        self.model = connector.model
        self.cache = connector.shared_cache
        self.layout = connector.layout
        self.accelerator: Optional[BlendAccelerator] = connector.accelerators.get(BlendAccelerator)
        self.options = options or (self.accelerator.options if self.accelerator else BlendOptions())
        self.timeout_s = timeout_s
        self.device = torch.device(self.model.device)
        self.dtype = self.model.dtype
        self._lock = threading.Lock()
        self._inflight: list[tuple[Handle, Any]] = []
        self.last_report: Optional[BlendReport] = None  # of the last `generate`
        try:
            self.rope: Optional[RopeSpec] = rope_of(self.model)
            self._layers = list(self.model.model.layers)
            self._embed = self.model.model.embed_tokens
            self._rotary = self.model.model.rotary_emb
            self.why_not = ""
        except (ModelError, AttributeError) as exc:
            self.rope, self.why_not = None, str(exc)
        ns = connector.namespace
        self.namespace: Optional[Namespace] = None if self.rope is None else Namespace(
            model=ns.model, kv_dtype=ns.kv_dtype, num_layers=ns.num_layers, num_kv_heads=ns.num_kv_heads,
            head_size=ns.head_size, block_tokens=ns.block_tokens, tp_rank=ns.tp_rank, tp_size=ns.tp_size,
            layout=f"chunk-pos0-rope-{self.rope.style}-{self.rope.digest}-{ns.layout}", salt=ns.salt)

    # ---- the public calls ------------------------------------------------------------
    def generate(self, input_ids: Any, chunks: Sequence[tuple[int, int]], attention_mask: Any = None,
                 **kwargs: Any) -> Any:
        """`model.generate` over `input_ids` (one row, unpadded: an
        `attention_mask` must be all ones) whose `chunks` (spans [start,
        end) of token positions, in order, not overlapping) are blended; a
        model blending does not support is generated in full."""
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
            raise ArgumentError("blend: one unpadded prompt; its attention_mask must be all ones")
        ids = self._row(input_ids)
        cache, report = self.prefill(ids, chunks)
        self.last_report = report
        row = ids[None].to(self.device)
        mask = torch.ones_like(row)
        if cache is None:
            return self.model.generate(input_ids=row, attention_mask=mask, **kwargs)
        return self.model.generate(input_ids=row, attention_mask=mask, past_key_values=cache, **kwargs)

    def prefill(self, input_ids: Any, chunks: Sequence[tuple[int, int]]) -> tuple[Any, BlendReport]:
        """The blended DynamicCache of the prompt's tokens but its last
        (module docstring) and its report; (None, report) where blending
        is not supported for this model."""
        from transformers import DynamicCache

        ids = self._row(input_ids)
        spans = _check_spans(chunks, len(ids))
        report = BlendReport()
        if self.rope is None:
            report.unsupported = True
            self._record({"unsupported": 1})
            return None, report
        n = len(ids) - 1  # the question but its last token is computed with the recompute; generate computes that one
        if not spans or n <= 0:
            return None, report
        with torch.no_grad():
            keys, values, reused, exact = self._assemble(ids, spans, n, report)
            selected = self._select(ids, keys, values, reused, exact, spans, n, report)
        cache = DynamicCache()
        for layer in range(len(keys)):
            cache.update(keys[layer], values[layer], layer)
        report.blended_tokens = n
        report.reused_tokens = int(reused[:n].sum())
        report.recomputed_tokens = len(selected)
        report.selected = selected
        layers, checked = len(keys), self._checked_layers()
        report.layer_tokens += checked * int((~exact[:n]).sum()) + (layers - checked) * len(selected)
        self._record({"requests": 1, "chunks_hit": report.chunks_hit, "chunks_computed": report.chunks_computed,
                      "reused_tokens": report.reused_tokens, "recomputed_tokens": report.recomputed_tokens})
        return cache, report

    def wait_stores(self, timeout_s: float = 60.0) -> bool:
        with self._lock:
            pending = list(self._inflight)
        return all(h.wait(timeout_s) is not None for h, _ in pending)

    # ---- chunks as entries -----------------------------------------------------------
    def chunk_keys(self, tokens: Sequence[int], prefix: Sequence[int] = ()) -> list:
        """The block keys of a chunk's entry: computed after `prefix` (empty:
        alone at position 0)."""
        ns = self.namespace_after(prefix)
        return block_keys(ns, list(tokens)) if ns is not None else []

    def namespace_after(self, prefix: Sequence[int]) -> Optional[Namespace]:
        """The namespace of chunks computed after `prefix` (`namespace` for
        none): the prefix's length and a digest of its tokens in the
        layout."""
        if self.namespace is None or not len(prefix):
            return self.namespace
        digest = hashlib.blake2b(torch.tensor(list(prefix), dtype=torch.int64).numpy().tobytes(),
                                 digest_size=8).hexdigest()
        return dataclasses.replace(self.namespace, layout=f"after-{len(prefix)}-{digest}-{self.namespace.layout}")

    def _chunk_kv(self, tokens: torch.Tensor, report: BlendReport, prefix: Optional["_Prefix"] = None
                  ) -> tuple[list, list, int]:
        """Per layer, K and V `[kv_heads, t, head_dim]` of the chunk computed
        after `prefix` (or alone) at positions len(prefix).., for its t
        tokens in whole blocks (read from the cache, or computed and
        stored)."""
        bt = self.layout.block_tokens
        keys = self.chunk_keys(tokens.tolist(), prefix.ids if prefix is not None else ())
        if not keys:
            return [], [], 0
        got = self._load(keys)
        if got is not None:
            report.chunks_hit += 1
            report.chunk_blocks_loaded += len(keys)
            payload = got.to(self.device)
        else:
            report.chunks_computed += 1
            t = len(keys) * bt
            row = tokens[None].to(self.device)
            if prefix is None:
                kv, at = self.model(input_ids=row, use_cache=True, logits_to_keep=1).past_key_values, 0
            else:
                kv, at = prefix.cache(), len(prefix.ids)
                self.model(input_ids=row, past_key_values=kv, use_cache=True, logits_to_keep=1)
            payload = torch.stack([torch.stack((kv.layers[layer].keys[0, :, at:at + t],
                                                kv.layers[layer].values[0, :, at:at + t]))
                                   for layer in range(len(kv.layers))])  # [L, 2, H, t, D]
            if prefix is not None:
                kv.crop(at - kv.get_seq_length())  # back to the prefix (a negative count drops that many)
            payload = payload.reshape(*payload.shape[:3], len(keys), bt, payload.shape[-1]).permute(3, 0, 1, 2, 4, 5)
            self._store(keys, payload.contiguous(), report)
        # payload [blocks, L, 2, H, bt, D] -> per layer [H, blocks * bt, D]
        p = payload.permute(1, 2, 3, 0, 4, 5).reshape(payload.shape[1], 2, payload.shape[3], -1, payload.shape[-1])
        return [p[layer, 0] for layer in range(p.shape[0])], [p[layer, 1] for layer in range(p.shape[0])], p.shape[3]

    def _load(self, keys: list) -> Optional[torch.Tensor]:
        """The chunk's blocks `[blocks, *layout.shape]` on the CPU, or None
        (not all cached, a failed or late load, a fault)."""
        try:
            if self.cache.lookup(keys) < len(keys):
                return None
            payload = torch.empty((len(keys), *self.layout.shape), dtype=self.dtype)
            handle = self.cache.load(keys, [payload[i] for i in range(len(keys))])
            out = handle.wait(self.timeout_s)
            if out is None or any(o is not Outcome.DONE for o in out):
                self._record({"chunk_load_failed": 1})
                return None
            return payload
        except Exception:
            log.warning("ucm blend: loading a chunk failed; it is computed", exc_info=True)
            self._record({"chunk_load_failed": 1})
            return None

    def _store(self, keys: list, payload: torch.Tensor, report: BlendReport) -> None:
        host = payload if payload.device.type == "cpu" else payload.to("cpu")
        try:
            handle = self.cache.store(keys, [host[i] for i in range(len(keys))])
        except Exception:
            log.warning("ucm blend: storing a chunk failed; it is not cached", exc_info=True)
            return
        report.chunk_blocks_stored += len(keys)
        with self._lock:
            self._inflight = [(h, s) for h, s in self._inflight if not h.done()] + [(handle, host)]

    # ---- the blend ---------------------------------------------------------------------
    def _assemble(self, ids: torch.Tensor, spans: list, n: int, report: BlendReport):
        """Per layer, the blended K and V `[1, kv_heads, n, head_dim]`; which
        positions hold reused KV, and which are exact (the system prompt's)."""
        lay = self.layout
        shape = (1, lay.num_kv_heads, n, lay.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(lay.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(lay.num_layers)]
        reused = torch.zeros(n, dtype=torch.bool)
        exact = torch.zeros(n, dtype=torch.bool)
        first = spans[0][0] if spans else n
        prefix = _Prefix(self.model, ids[:first], self.device) if self.options.context == "prefix" and first else None
        at = len(prefix.ids) if prefix is not None else 0  # where the chunks were computed
        if first > 0:
            self._place(keys, values, reused, *self._chunk_kv(ids[:first], report), 0, 0, n)
            exact[:min(first, n)] = reused[:min(first, n)]
        for s, e in spans:
            self._place(keys, values, reused, *self._chunk_kv(ids[s:e], report, prefix), s, at, n)
        return keys, values, reused, exact

    def _place(self, keys: list, values: list, reused: torch.Tensor, ks: list, vs: list, t: int, s: int, at: int,
               n: int) -> None:
        """A chunk's K (rotated from position `at` to `s`) and V into the
        blended K/V at s.."""
        t = min(t, n - s)
        if t <= 0:
            return
        for layer in range(len(keys)):
            k = ks[layer][:, :t]
            keys[layer][0, :, s:s + t] = k if s == at else rotate(k, s - at, self.rope)
            values[layer][0, :, s:s + t] = vs[layer][:, :t]
        reused[s:s + t] = True

    def _select(self, ids: torch.Tensor, keys: list, values: list, reused: torch.Tensor, exact: torch.Tensor,
                spans: list, n: int, report: BlendReport) -> list[int]:
        """Recomputes the chosen tokens (module docstring) into `keys` and
        `values`; answers their positions."""
        plan = select(self.options, reused, exact, spans, n)
        start = self._checked_layers()
        hidden: Optional[torch.Tensor] = None
        if self.options.select == "question" and plan.budget:
            # the question (after the last chunk) and what no entry covers before it in one pass (as at ratio 0)
            end = min(spans[-1][1], n)
            uncovered = torch.nonzero(~reused[:end]).flatten()
            pos = torch.nonzero(~exact[:end]).flatten()
            plan.add_top(self._question(ids, keys, values, end, uncovered)[pos], pos)
            report.layer_tokens += (len(uncovered) + len(ids) - end) * len(keys)  # the probe's pass
        elif start:  # deviation: the checked layers for every token after the system prompt, then a probe
            pos = torch.nonzero(~exact[:n]).flatten()
            hidden = self._run(ids, keys, values, pos, 0, start)
            if plan.budget and start < len(keys):
                plan.add_top(self._deviation(hidden, pos, keys[start], values[start], start), pos)
            elif plan.budget:
                plan.chosen |= plan.candidates
            hidden = hidden[:, plan.chosen[pos].to(hidden.device)]
        positions = torch.nonzero(plan.chosen).flatten()
        if len(positions) and start < len(keys):
            self._run(ids, keys, values, positions, start, len(keys), hidden, kv_only_last=True)
        return positions.tolist()

    def _run(self, ids: torch.Tensor, keys: list, values: list, positions: torch.Tensor, first: int, last: int,
             hidden: Optional[torch.Tensor] = None, kv_only_last: bool = False) -> Optional[torch.Tensor]:
        """Layers first..last-1 for the tokens at `positions` (hidden states
        from the embeddings when `hidden` is None), writing their K/V into
        the blended K/V; answers their hidden states after layer last-1, or
        with `kv_only_last` None: layer last-1 stops once its K/V are
        written (its attention and MLP would feed nothing)."""
        pos = positions.to(self.device)
        h = self._embed(ids[positions][None].to(self.device)) if hidden is None else hidden
        kv = _BlendKV(keys, values)
        kv.positions = pos
        pid = pos[None]
        emb = self._rotary(h, pid)
        mask = self._mask(pos, keys[0].shape[2], h.dtype)
        base = getattr(self.model.config, "_attn_implementation", None)  # as transformers' attention docs read it
        banded = base == "sdpa" and len(pos) > 1 and first < last
        extra = {"ucm_bands": bands(pos)} if banded else {}
        if banded:
            self.model.set_attn_implementation(banded_sdpa())
        try:
            for i in range(first, last):
                kv.probe = kv_only_last and i == last - 1
                try:
                    h = _hidden(self._layers[i](h, attention_mask=mask, position_ids=pid, past_key_values=kv,
                                                position_embeddings=emb, use_cache=True, **extra))
                except _Probed:
                    return None
        finally:
            if banded:
                self.model.set_attn_implementation(base)
        return h

    def _question(self, ids: torch.Tensor, keys: list, values: list, end: int, uncovered: torch.Tensor
                  ) -> torch.Tensor:
        """Per position [0, end), the attention the tokens after `end` (the
        question) pay it over the blended K/V before any recompute, in the
        layers `question_layers` names; the `uncovered` positions (< end)
        computed in the same pass, written into the blended K/V."""
        counted = question_layers(self.options, len(self._layers))
        return question_attention(self.model, self._layers[:counted.stop], self._embed, self._rotary, ids,
                                  [k[:, :, :end] for k in keys], [v[:, :, :end] for v in values], counted, uncovered)

    def _deviation(self, hidden: torch.Tensor, pos: torch.Tensor, k_reused: torch.Tensor, v_reused: torch.Tensor,
                   layer: int) -> torch.Tensor:
        """Per token at `pos`, how far the K/V layer `layer` projects from
        its hidden state lie from the blended (reused) K/V."""
        kv = _BlendKV([], [])
        kv.probe = True
        p = pos.to(self.device)
        emb = self._rotary(hidden, p[None])
        try:
            self._layers[layer](hidden, attention_mask=None, position_ids=p[None], past_key_values=kv,
                                position_embeddings=emb, use_cache=True)
        except _Probed:
            pass
        if kv.caught is None:
            raise ModelError(f"blend: layer {layer} did not pass its K/V to the cache")
        k, v = kv.caught
        dk = (k.float() - k_reused[:, :, p].float()).pow(2).sum(dim=(0, 1, 3))
        dv = (v.float() - v_reused[:, :, p].float()).pow(2).sum(dim=(0, 1, 3))
        return (dk + dv).cpu()

    def _mask(self, pos: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, queries, n]: 0 where a key's position is at most the
        query's, the dtype's lowest elsewhere."""
        allowed = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    # ---- helpers -----------------------------------------------------------------------
    def _checked_layers(self) -> int:
        """The layers computed for every token after the system prompt."""
        return checked_layers(self.options, len(self._layers))

    def _row(self, input_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise ArgumentError(f"blend: one prompt at a time, got a batch of {ids.shape[0]}")
            ids = ids[0]
        if ids.ndim != 1 or not len(ids):
            raise ArgumentError("blend: input_ids must be one non-empty row of token ids")
        return ids.to("cpu", torch.long)

    def _record(self, counts: dict) -> None:
        if self.accelerator is not None:
            self.accelerator.record(counts)


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _check_spans(chunks: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The chunk spans, checked: ints, 0 <= start < end <= length, in order,
    not overlapping (ArgumentError naming the bad one)."""
    out: list[tuple[int, int]] = []
    prev = 0
    for i, span in enumerate(chunks):
        try:
            s, e = (int(x) for x in span)
        except (TypeError, ValueError):
            raise ArgumentError(f"chunks[{i}]: must be a (start, end) pair of ints, got {span!r}") from None
        if not prev <= s < e <= length:
            raise ArgumentError(f"chunks[{i}]: ({s}, {e}) must satisfy {prev} <= start < end <= {length} (in order, "
                                f"not overlapping, within the prompt)")
        out.append((s, e))
        prev = e
    return out
