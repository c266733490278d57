"""VllmBlender: a blended prefill inside vLLM for CPU, with vLLM's own
model, before the forward of the step that schedules the request
(decision 20).

The scheduler side (scheduler.py, blend_request.py) claims a blended
request's first N tokens as an external hit and ships a `BlendJob`; vLLM
then runs `start_load_kv` before the forward (a synchronous external hit
sets `has_sync_kv_loads`), where the connector calls `blend(job)`. It
fills the request's pages for [0, N) with vLLM's own decoder layers, under
a forward context of its own (`override_forward_context`) whose CPU_ATTN
rows are built here:

1. the system prompt (the tokens before the first chunk, from vLLM's own
   hit on) in every layer, one row: exact;
2. each chunk's entry read from ucm (`CacheAPI.load`; whole blocks of
   `block_tokens`, a `[layers, 2, kv_heads, block_tokens, head_size]`
   tensor per block) or, where any block is missing, computed: its tokens
   as one row at the positions right after the system prompt, each
   layer's K/V taken as it enters the layer's attention (a forward
   pre-hook on vLLM's `Attention`), and stored;
3. each chunk's K rotated from where it was computed to its place by the
   model's own `rotary_emb` (rotations compose: R(q) = R(q - p) R(p)), and
   its K/V written into the request's slots (the attention impl's own
   `do_kv_cache_update`);
4. the selection (ucm/connectors/blend_select.py, the `blend`
   accelerator's options): under `deviation`, layers 0..check-1 for every
   token after the system prompt as one row, the check layer's K/V of
   those tokens caught at its attention and compared with the reused K/V;
   under `question`, the prompt's tokens after the blended part (the
   question, which vLLM's forward computes afterwards) through every layer
   as one more row after the tokens no entry covers, each counted layer's
   queries caught at its attention and weighed against the layer's keys,
   read back from the pages (page_keys.py: the order CPU_ATTN's own write
   gives them, learnt once), so that the reused tokens the question
   attends to most are chosen (decision 21);
   then the chosen tokens through the remaining layers, one CPU_ATTN row
   per run of consecutive positions: a row is causal with its queries at
   the end of its context, and each layer writes its fresh K/V through the
   slot mapping before attending, so a chosen token attends over the
   blended K/V with the fresh K/V of the chosen tokens before it.

Anything that fails raises: the connector reports the job's pages as load
errors and vLLM recomputes the request in full (never the blended bytes
served as something else). The request's blocks are never saved under
the exact namespace (the scheduler plans no save for it).

Refused at construction (ModelError; the connector then answers blended
requests with load errors, which vLLM recomputes): a model without
`model.layers[i].self_attn.{attn, rotary_emb}` (vLLM's Llama family), a
RoPE whose rotation depends on the sequence (anything but
MOVABLE_ROTARIES) or differs between layers, an attention impl other than
vLLM's stock CPU one (the sparse-decode plugin's included), more than one
KV cache group.

Thread: vLLM's worker thread, inside `start_load_kv`.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch

from ucm.accelerators.blend import BlendOptions
from ucm.api import CacheAPI, Outcome
from ucm.connectors.blend_select import checked_layers, question_layers, question_mass, select
from ucm.connectors.vllm.metadata import BlendJob
from ucm.connectors.vllm.page_keys import PageKeys
from ucm.errors import ModelError, UcmError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

# vLLM rotary embeddings whose angles are position * fixed frequencies.
MOVABLE_ROTARIES = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding")
STOCK_IMPL = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"


class _Probed(Exception):
    """Stops a layer once its attention's K/V were caught."""


class VllmBlender:
    """Blends the jobs the scheduler side ships, over one vLLM model (module
    docstring). `stats()` counts what it did."""

    def __init__(self, model: Any, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cache: CacheAPI,
                 options: BlendOptions, timeout_s: float = 30.0) -> None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ModelError("blend: one KV cache group only")
        try:
            inner = model.model
            self.layers = list(inner.layers)
            self.attns = [layer.self_attn.attn for layer in self.layers]
            self.rotary = self.layers[0].self_attn.rotary_emb
            self.embed = getattr(inner, "embed_input_ids", None) or inner.embed_tokens
        except AttributeError as exc:
            raise ModelError(f"blend: {type(model).__name__} is not a model whose decoder layers ucm can call "
                             f"({exc})") from exc
        kind = type(self.rotary).__name__
        if kind not in MOVABLE_ROTARIES:
            raise ModelError(f"blend: the rotary embedding {kind} cannot move keys; supported: "
                             f"{list(MOVABLE_ROTARIES)}")
        for i, layer in enumerate(self.layers):  # keys are moved with one rotation for every layer
            other = layer.self_attn.rotary_emb
            if other is not self.rotary and not (type(other) is type(self.rotary) and torch.equal(
                    other.cos_sin_cache, self.rotary.cos_sin_cache)):
                raise ModelError(f"blend: layer {i} rotates its keys unlike layer 0 (per-layer RoPE)")
        for attn in self.attns:
            impl = type(attn.impl)
            if f"{impl.__module__}.{impl.__qualname__}" != STOCK_IMPL:
                raise ModelError(f"blend: attention impl {impl.__qualname__} is not vLLM's {STOCK_IMPL}")
        group = kv_cache_config.kv_cache_groups[0]
        self.layer_names = [attn.layer_name for attn in self.attns]
        self.builder = CPUAttentionMetadataBuilder(group.kv_cache_spec, list(group.layer_names), vllm_config,
                                                   torch.device("cpu"))
        self.vllm_config = vllm_config
        self.page_tokens = group.kv_cache_spec.block_size
        self.kv_heads = group.kv_cache_spec.num_kv_heads
        self.head_size = group.kv_cache_spec.head_size
        self.dtype = vllm_config.model_config.dtype
        self.cache = cache
        self.options = options
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._inflight: list[tuple[Any, Any]] = []  # stores in flight and their sources
        self._page_keys: Optional[PageKeys] = None  # learnt on the first `question` selection
        self._last_selected: list[int] = []

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def last_selected(self) -> list[int]:
        """The positions the last blend recomputed in every layer after the
        checked ones (the tokens no entry covers and the selection)."""
        with self._lock:
            return list(self._last_selected)

    # ---- a job ---------------------------------------------------------------------------
    def blend(self, job: BlendJob) -> None:
        """Fills the job's pages (module docstring); raises on any failure."""
        with torch.inference_mode():
            counts = self._blend(job)
        with self._lock:
            self._counts.update(counts)

    def _blend(self, job: BlendJob) -> Counter:
        counts: Counter = Counter(requests=1)
        options = BlendOptions(**{**self.options.model_dump(), **job.options}) if job.options else self.options
        ids = torch.tensor(job.tokens, dtype=torch.long)
        n, s0 = len(ids), job.spans[0][0]
        pages = torch.tensor(job.page_ids[:-(-n // self.page_tokens)], dtype=torch.int32)
        if job.start < s0:  # the system prompt, exact
            self._forward(ids[job.start:s0], [(job.start, s0)], pages, 0, len(self.layers))
            counts["system_tokens"] += s0 - job.start
        entries = [self._entry(ids, s, keys, job.block_tokens, s0, pages, counts)
                   for (s, _e), keys in zip(job.spans, job.keys)]
        reused = torch.zeros(n, dtype=torch.bool)
        exact = torch.zeros(n, dtype=torch.bool)
        reused[:s0] = exact[:s0] = True
        c = checked_layers(options, len(self.layers))
        ref: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        if 0 < c < len(self.layers):
            ref = (torch.zeros((n, self.kv_heads, self.head_size), dtype=self.dtype),
                   torch.zeros((n, self.kv_heads, self.head_size), dtype=self.dtype))
        for (s, _e), kv in zip(job.spans, entries):
            t = 0 if kv is None else min(kv[0].shape[1], n - s)
            if t > 0:
                self._place(kv[0][:, :t], kv[1][:, :t], s, s - s0, pages, ref, c)
                reused[s:s + t] = True
                counts["reused_tokens"] += t
        plan = select(options, reused, exact, job.spans, n)
        hidden = residual = None
        if options.select == "question" and plan.budget:
            pos = torch.nonzero(~exact[:n]).flatten()
            plan.add_top(self._question(ids, job, reused, question_layers(options, len(self.layers)), counts)[pos],
                         pos)
        elif c:  # the checked layers for every token after the system prompt, then the probe
            hidden, residual = self._forward(ids[s0:n], [(s0, n)], pages, 0, c)
            pos = torch.arange(s0, n)
            if plan.budget and ref is not None:
                k, v = self._probe(ids[s0:n], [(s0, n)], pages, c, hidden, residual)
                dev = ((k.float() - ref[0][s0:n].float()).pow(2).sum(dim=(1, 2))
                       + (v.float() - ref[1][s0:n].float()).pow(2).sum(dim=(1, 2)))
                plan.add_top(dev, pos)
            elif plan.budget:
                plan.chosen |= plan.candidates
            keep = plan.chosen[s0:n]
            hidden, residual = hidden[keep], residual[keep]
        chosen = torch.nonzero(plan.chosen).flatten()
        if len(chosen) and c < len(self.layers):
            self._forward(ids[chosen], _runs(chosen), pages, c, len(self.layers), hidden, residual)
        counts["recomputed_tokens"] += len(chosen)
        counts["blended_tokens"] += n
        with self._lock:
            self._last_selected = chosen.tolist()
        return counts

    def _question(self, ids: torch.Tensor, job: BlendJob, reused: torch.Tensor, counted: range, counts: Counter
                  ) -> torch.Tensor:
        """Per position [0, n), the attention the question (the prompt's
        tokens after the blended part, as far as the request's pages reach)
        pays it over the blended K/V before any recompute, summed over
        heads, its tokens and the `counted` layers: the question runs
        through vLLM's layers as one more row after the tokens no entry
        covers (computed as at ratio 0, written to their slots; the
        question's slots vLLM's forward writes again), each counted layer's
        queries caught at its attention and weighed against the layer's
        keys read back from the pages."""
        n, pt = len(ids), self.page_tokens
        pages = torch.tensor(job.page_ids, dtype=torch.int32)
        q = min(len(job.question), len(pages) * pt - n)
        if q <= 0:
            raise UcmError(f"blend: request {job.req_id} has no question tokens within its pages to select by")
        uncovered = torch.nonzero(~reused[:n]).flatten()
        rows = (_runs(uncovered) if len(uncovered) else []) + [(n, n + q)]
        tokens = torch.cat([ids[uncovered], torch.tensor(job.question[:q], dtype=torch.long)])
        keys = self._keys_reader()
        everything = torch.arange(n)
        mass = torch.zeros(n, dtype=torch.float32)

        def weigh(i: int, query: torch.Tensor, key: torch.Tensor, _value: torch.Tensor) -> None:
            fresh = key.reshape(-1, self.kv_heads, self.head_size)
            blended = keys.read(self.attns[i].kv_cache, pages, everything)
            blended[uncovered] = fresh[:len(uncovered)]  # this layer writes them only after this hook
            mass.add_(question_mass(query[-q:].reshape(q, -1, self.head_size), torch.cat([blended, fresh[-q:]]),
                                    self.attns[i].impl.scale, n))

        try:
            with self._hooked(counted, weigh, stop=counted.stop - 1):
                self._forward(tokens, rows, pages, 0, counted.stop)
        except _Probed:
            pass
        counts["probe_tokens"] += len(tokens)
        counts["probe_layer_tokens"] += len(tokens) * counted.stop
        return mass

    def _keys_reader(self) -> PageKeys:
        if self._page_keys is None:
            attn = self.attns[0]
            self._page_keys = PageKeys(lambda k, v, cache, slots: attn.impl.do_kv_cache_update(attn, k, v, cache, slots),
                                       self.kv_heads, self.page_tokens, self.head_size, attn.kv_cache.dtype)
        return self._page_keys

    # ---- chunks as entries -----------------------------------------------------------------
    def _entry(self, ids: torch.Tensor, s: int, keys: list, block_tokens: int, s0: int, pages: torch.Tensor,
               counts: Counter) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk at `s`'s entry, K and V `[layers, t, kv_heads,
        head_size]` as computed at s0.. (read, or computed and stored); None
        for a chunk shorter than a block."""
        if not keys:
            return None
        t = len(keys) * block_tokens
        payload = self._load(keys, block_tokens)
        if payload is not None:
            counts["chunks_hit"] += 1
            counts["chunk_blocks_loaded"] += len(keys)
        else:
            counts["chunks_computed"] += 1
            with self._catch(range(len(self.layers))) as caught:
                self._forward(ids[s:s + t], [(s0, s0 + t)], pages, 0, len(self.layers))
            kv = torch.stack([torch.stack(caught[i]) for i in range(len(self.layers))])  # [L, 2, t, H, D]
            payload = kv.view(*kv.shape[:2], len(keys), block_tokens, self.kv_heads, self.head_size)
            payload = payload.permute(2, 0, 1, 4, 3, 5).contiguous()  # [blocks, L, 2, H, bt, D]
            self._store(keys, payload)
            counts["chunk_blocks_stored"] += len(keys)
        kv = payload.permute(1, 2, 0, 4, 3, 5).reshape(len(self.layers), 2, t, self.kv_heads, self.head_size)
        return kv[:, 0], kv[:, 1]

    def _load(self, keys: list, block_tokens: int) -> Optional[torch.Tensor]:
        """The chunk's blocks, or None (not all cached, a failed or late
        load: the chunk is computed)."""
        try:
            if self.cache.lookup(keys) < len(keys):
                return None
            payload = torch.empty((len(keys), len(self.layers), 2, self.kv_heads, block_tokens, self.head_size),
                                  dtype=self.dtype)
            out = self.cache.load(keys, [payload[i] for i in range(len(keys))]).wait(self.timeout_s)
            if out is None or any(o is not Outcome.DONE for o in out):
                return None
            return payload
        except Exception:
            log.warning("ucm blend: loading a chunk failed; it is computed", exc_info=True)
            return None

    def _store(self, keys: list, payload: torch.Tensor) -> None:
        try:
            handle = self.cache.store(keys, [payload[i] for i in range(len(keys))])
        except Exception:
            log.warning("ucm blend: storing a chunk failed; it is not cached", exc_info=True)
            return
        with self._lock:
            self._inflight = [(h, p) for h, p in self._inflight if not h.done()] + [(handle, payload)]

    # ---- the layers --------------------------------------------------------------------
    def _place(self, k: torch.Tensor, v: torch.Tensor, s: int, delta: int, pages: torch.Tensor,
               ref: Optional[tuple[torch.Tensor, torch.Tensor]], c: int) -> None:
        """A chunk's K (`[layers, t, H, D]`, rotated by `delta` positions)
        and V into the request's slots at s..; the check layer's into `ref`."""
        t = k.shape[1]
        if delta:
            k = rotate_keys(self.rotary, k, delta)
        slots = self._slots(torch.arange(s, s + t), pages)
        for i, attn in enumerate(self.attns):
            attn.impl.do_kv_cache_update(attn, k[i].contiguous(), v[i].contiguous(), attn.kv_cache, slots)
        if ref is not None:
            ref[0][s:s + t], ref[1][s:s + t] = k[c], v[c]

    def _forward(self, tokens: torch.Tensor, rows: list[tuple[int, int]], pages: torch.Tensor, first: int,
                 last: int, hidden: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers first..last-1 for `tokens` at the positions of `rows`
        (hidden states from the embeddings when `hidden` is None), writing
        their K/V into the request's slots; answers the hidden states and
        residual after layer last-1."""
        from vllm.forward_context import override_forward_context

        context, positions = self._context(rows, pages)
        with override_forward_context(context):
            if hidden is None:
                hidden, residual = self.embed(tokens), None
            for layer in self.layers[first:last]:
                hidden, residual = layer(positions, hidden, residual)
        return hidden, residual

    def _probe(self, tokens: torch.Tensor, rows: list[tuple[int, int]], pages: torch.Tensor, layer: int,
               hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K/V `[tokens, H, D]` for the tokens of `rows`,
        caught as they enter its attention (nothing is written)."""
        from vllm.forward_context import override_forward_context

        context, positions = self._context(rows, pages)
        with override_forward_context(context), self._catch([layer], stop=True) as caught:
            try:  # the layer's norm adds the residual in place: it gets copies
                self.layers[layer](positions, hidden.clone(), residual.clone())
            except _Probed:
                pass
        if layer not in caught:
            raise UcmError(f"blend: layer {layer}'s attention was not called")
        return caught[layer]

    @contextmanager
    def _catch(self, layers: Any, stop: bool = False) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer in `layers`, the K/V `[tokens, H, D]` its attention is
        called with (after RoPE); `stop` ends the layer there."""
        caught: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(i: int, _query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
            caught[i] = (key.reshape(-1, self.kv_heads, self.head_size).clone(),
                         value.reshape(-1, self.kv_heads, self.head_size).clone())
            if stop:
                raise _Probed

        with self._hooked(layers, keep):
            yield caught

    @contextmanager
    def _hooked(self, layers: Any, fn: Any, stop: Optional[int] = None) -> Iterator[None]:
        """`fn(layer, query, key, value)` as each layer in `layers` calls
        its attention (after RoPE); layer `stop` ends there (_Probed)."""
        def hook(i: int):
            def pre(_module: Any, args: tuple, kwargs: dict) -> None:
                query = args[0] if args else kwargs["query"]
                key = args[1] if len(args) > 1 else kwargs["key"]
                value = args[2] if len(args) > 2 else kwargs["value"]
                fn(i, query, key, value)
                if i == stop:
                    raise _Probed
            return pre

        handles = [self.attns[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _context(self, rows: list[tuple[int, int]], pages: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """A forward context for CPU_ATTN rows [a, b) of one request: each
        row's queries at a..b-1 attend causally over the request's
        positions < b; every layer writes the rows' K/V to their slots."""
        from vllm.forward_context import create_forward_context

        lens = torch.tensor([b - a for a, b in rows], dtype=torch.int32)
        query_start = torch.zeros(len(rows) + 1, dtype=torch.int32)
        query_start[1:] = torch.cumsum(lens, 0)
        seq_lens = torch.tensor([b for _a, b in rows], dtype=torch.int32)
        positions = torch.cat([torch.arange(a, b) for a, b in rows])
        slots = self._slots(positions, pages)
        common = SimpleNamespace(  # the fields CPUAttentionMetadataBuilder.build reads
            num_reqs=len(rows), num_actual_tokens=int(lens.sum()), max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=query_start, seq_lens=seq_lens,
            block_table_tensor=pages[None].expand(len(rows), -1).contiguous(), slot_mapping=slots, causal=True)
        meta = self.builder.build(0, common)
        context = create_forward_context({name: meta for name in self.layer_names}, self.vllm_config,
                                         slot_mapping={name: slots for name in self.layer_names})
        return context, positions

    def _slots(self, positions: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        pt = self.page_tokens
        return pages[positions // pt].long() * pt + positions % pt


def rotate_keys(rotary: Any, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """`keys` (`[..., heads, head_size]`, computed at some positions) moved
    `delta` positions on by the model's own `rotary` embedding: a rotation
    of delta * each frequency, so that a key computed at p becomes the key
    computed at p + delta (module docstring)."""
    shape = keys.shape
    flat = keys.reshape(-1, shape[-2] * shape[-1]).clone()  # vLLM's rotary works in place
    query = torch.zeros((flat.shape[0], shape[-1]), dtype=flat.dtype)
    _, flat = rotary(torch.full((flat.shape[0],), delta, dtype=torch.long), query, flat)
    return flat.view(shape)


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted positions as runs [a, b) of consecutive ones."""
    p = positions.tolist()
    runs, a = [], p[0]
    for prev, cur in zip(p, p[1:]):
        if cur != prev + 1:
            runs.append((a, prev + 1))
            a = cur
    runs.append((a, p[-1] + 1))
    return runs
