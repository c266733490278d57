"""Sparse decode for transformers: each decode step attends, per layer, only
over the tokens a selector picked, the picked pages read from ucm.

What it selects by is the `sparse` accelerator (SparseAccelerator,
ucm/accelerators/sparse/accelerator.py), enabled in the YAML file of the
cache the connector is given:

    accelerators:
      - name: sparse
        options: {selector: hybrid, budget: {tokens: 1024}, sink_tokens: 128, local_tokens: 256}

The connector then builds its engine-side chain from that config, takes
the accelerator by type and decodes its `generate` calls through a
`SparseDecoder` of it (connector.py). A decoder can also be made by hand,
over the connector's accelerator or over one of its own:

    decoder = SparseDecoder(connector)                     # the YAML's accelerator (or the defaults)
    decoder = SparseDecoder(connector, SparseDecodeConfig(selector="quest", budget=Budget.tokens(1024)))
    out = decoder.generate(input_ids, max_new_tokens=64)   # connector.generate, decoded sparsely
    decoder.stats()                                        # bytes read per tier per decoded token, ...

`SparseDecodeConfig(selector=..., budget=..., ...)` is a convenience: its
SparseOptions keywords build a SparseAccelerator the way the YAML entry
with those options does (the same engine-side chain build), so there is
one way sparse decode is configured inside.

How. `register()` adds attention functions `ucm_sparse_eager` and
`ucm_sparse_sdpa` to transformers' `AttentionInterface` (and the matching
mask functions to `AttentionMaskInterface`, so prefill keeps its causal
mask). `generate` switches the model to one of them for the call and makes
its session the active one (a ContextVar: only this thread's forward passes
see it). Without an active session, for prefill (more than one query
token), for a batch of more than one row or a left-padded row, the function
is its base (`eager`, the same operations as transformers' eager, or
`sdpa`): prefill (the session's first forward, whatever its length) stays
dense. Every context is decoded sparsely, whatever its length: the
accelerator's `min_context_tokens` is read by the vLLM backend only.

At a decode step, for layer l (the selection of the layer is shared by its
query heads; ucm/accelerators/sparse/base.py):
- every `reselect_every` steps the selector scores the prefix's pages from
  their summaries (a `SummaryIndex` fed by the connector's stores, and for
  blocks it lacks, e.g. a restored prefix, from the resident keys at the
  first step) and picks the pages within the budget; sink, local window and
  tail (decoded tokens and the prompt's last, partial block) are always kept;
- the picked pages' K and V of layer l are read from the cache by ranges
  (sparse_fetch.py: `read_ranges`, only the pages' bytes) and kept for the
  steps until the next selection; at that selection, pages the layer
  already holds and picks again are reused, only the newly picked ones are
  read (`pages_reused`; a stored page never changes, so this is exact); the
  other kept tokens come from the layer's resident tensors;
- attention runs over exactly those tokens, in sequence order, with the
  mask's columns of those tokens.

What stays resident. The layers still hold the whole KV (the connector's
UCMCache): the fetched pages are real reads from the tiers, but the gain is
bandwidth and compute of attention, not capacity. The resident KV is what
makes the fallback exact: a page that cannot be fetched (evicted, corrupt,
service down) makes that layer attend densely over the resident KV for the
step (`dense_fallbacks`), never over wrong or missing bytes, and nothing
raises into generate.

`lowrank` and the default `hybrid` (selectors.py) score tokens from their
projected keys, which the summaries keep when made with the decoder's `KeyBasis` (`rank`
leading directions per layer and KV head): the basis is fitted on the
first prompt decoded sparsely, from its full blocks' resident keys, and
kept for the decoder's life; blocks summarised before it (or restored)
are summarised again from the resident keys at that first step.

Figures: `stats()` answers the decoder's own; each generate call also adds
its figures to the accelerator (`SparseAccelerator.record`), so the
connector's `stats()["accelerators"]["sparse"]` sums every decoder of it.

Before the first sparse step the decoder waits for the connector's stores
of the prompt (`wait_stores`), so that the prompt's blocks can be read.
Runs in the caller's thread; a decoder serves one generate call at a time.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import numpy as np
import torch

from ucm.accelerators.base import validate_options
from ucm.accelerators.chain import Accelerators
from ucm.accelerators.sparse import (KeyBasis, LayerStep, Selection, SparseAccelerator, SparseOptions,
                                     fit_key_basis, layer_units, summarize_keys)
from ucm.config.schema import AcceleratorConfig
from ucm.connectors.transformers.kv_copy import byte_view
from ucm.connectors.transformers.sparse_fetch import FetchedPages, PageFetcher, reuse_pages
from ucm.errors import ArgumentError, ConfigError

if TYPE_CHECKING:
    from ucm.connectors.transformers.request_cache import UCMCache

log = logging.getLogger(__name__)

BASES = ("eager", "sdpa")
_ACTIVE: contextvars.ContextVar[Optional["_Session"]] = contextvars.ContextVar("ucm_sparse_session", default=None)


@dataclass(frozen=True, slots=True, init=False)
class SparseDecodeConfig:
    """What the transformers decoder itself decides, apart from what it
    selects by (the accelerator's): `base`, the dense attention of prefill
    and of a fallback (`eager` or `sdpa`), and `wait_stores_s`, how long
    the first sparse step waits for the prompt's stores.

    `options` (a SparseOptions), or SparseOptions' keywords (`selector`,
    `budget`, `sink_tokens`, `local_tokens`, `page_tokens`,
    `reselect_every`, `rank`, ...), make the decoder build a
    SparseAccelerator of its own from them, as a YAML entry with those
    options would; without them the decoder takes the connector's. A bad
    value is a ConfigError naming it."""

    base: str
    wait_stores_s: float
    options: Optional[SparseOptions]

    def __init__(self, *, base: str = "eager", wait_stores_s: float = 30.0, options: Optional[SparseOptions] = None,
                 **sparse_options: Any) -> None:
        if base not in BASES:
            raise ConfigError(f"SparseDecodeConfig.base {base!r} not one of {list(BASES)}")
        if sparse_options:
            if options is not None:
                raise ArgumentError(f"SparseDecodeConfig: give options or their keywords "
                                    f"({sorted(sparse_options)}), not both")
            options = validate_options(SparseAccelerator, sparse_options, prefix="SparseDecodeConfig.")
        elif options is not None and not isinstance(options, SparseOptions):
            raise ArgumentError(f"SparseDecodeConfig.options must be a SparseOptions, got {type(options).__name__}")
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "wait_stores_s", float(wait_stores_s))
        object.__setattr__(self, "options", options)


def _own_accelerator(connector: Any, options: SparseOptions) -> SparseAccelerator:
    """A SparseAccelerator of `options` over `connector`'s cache, built as
    the connector builds the one its YAML enables (its config with this one
    `sparse` entry, at the connector's block size, through the engine-side
    chain)."""
    entry = AcceleratorConfig(name=SparseAccelerator.name, options=dict(options))
    settings = connector.settings.model_copy(update={"block_tokens": connector.layout.block_tokens,
                                                     "accelerators": (entry,)})
    sparse = Accelerators.build(settings, connector.shared_cache, runs_in="engine").get(SparseAccelerator)
    if sparse is None:  # the entry point named `sparse` is not this class
        raise ConfigError(f"accelerator {SparseAccelerator.name!r} is not {SparseAccelerator.__qualname__}")
    return sparse


# ---- the attention functions -------------------------------------------------
def eager_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Optional[torch.Tensor], scaling: float, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager attention (the operations of modeling_llama's
    `eager_attention_forward`), GQA by repeating K/V."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, :k.shape[-2]]
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = torch.nn.functional.dropout(w, p=dropout, training=module.training)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def _base_fn(base: str) -> Any:
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return eager_attention


def _make_attention(base: str) -> Any:
    dense = _base_fn(base)

    def ucm_sparse_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
        session = _ACTIVE.get()
        if session is None:
            return dense(module, query, key, value, attention_mask, **kwargs)
        return session.attend(dense, module, query, key, value, attention_mask, **kwargs)

    return ucm_sparse_attention


def impl_name(base: str) -> str:
    return f"ucm_sparse_{base}"


def register() -> None:
    """Registers `ucm_sparse_eager` / `ucm_sparse_sdpa` with transformers
    (attention and mask functions; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"eager": eager_mask, "sdpa": sdpa_mask}
    registered = AttentionInterface()  # a fresh instance: only what `register` added, class-wide
    for base in BASES:
        if impl_name(base) not in registered:
            AttentionInterface.register(impl_name(base), _make_attention(base))
            AttentionMaskInterface.register(impl_name(base), masks[base])


# ---- the decoder ---------------------------------------------------------------
class SparseDecoder:
    """Sparse decode over a TransformersConnector's cache (module docstring).

    `sparse`: the accelerator to select by; default the one `config`'s
    options build, else the connector's (its YAML's), else one of the
    defaults. ConfigError when its pages do not divide the connector's
    blocks or its rank exceeds the model's head size."""

    def __init__(self, connector: Any, config: SparseDecodeConfig = SparseDecodeConfig(), *,
                 sparse: Optional[SparseAccelerator] = None) -> None:
        if sparse is not None and config.options is not None:
            raise ArgumentError("SparseDecoder: give the accelerator or SparseDecodeConfig's options, not both")
        if sparse is None:
            if config.options is not None:
                sparse = _own_accelerator(connector, config.options)
            else:
                sparse = connector.sparse or _own_accelerator(connector, SparseOptions())
        lay = connector.layout
        sparse.check_block_tokens(lay.block_tokens)
        self.selector = sparse.make_selector()
        sparse.check_head_dim(lay.head_dim)
        register()
        self.connector, self.config, self.sparse = connector, config, sparse
        self.options = sparse.options
        # summaries keep what the selector reads (quest: the bounds; lowrank: the projections alone; hybrid both)
        self.parts = sparse.summary_parts()
        self.index = sparse.new_index()
        self._kv_layout = lay.kv_layout()
        # the key basis of `lowrank` and `hybrid` (lowrank.py): fitted on the first prompt decoded sparsely (its full
        # blocks' keys, every layer and head), then kept for every later summary; None until then
        self.basis: Optional[KeyBasis] = None
        connector.block_observer = self._blocks_stored
        self.selection = sparse.selection
        self.counters: dict[str, Any] = {
            "decode_steps": 0, "sparse_layer_steps": 0, "dense_layer_steps": 0, "dense_fallbacks": 0,
            "selections": 0, "attended_tokens": 0, "context_tokens": 0, "summaries_from_layers": 0,
            "pages_reused": 0}
        self._fetch: dict[str, Any] = {}
        self.trace: Optional[list] = None  # set to [] to record (step, layer, positions attended) per sparse step

    def _blocks_stored(self, keys: list, payload: torch.Tensor) -> None:
        """The connector's store thread: summaries of the blocks it is about
        to store (`payload` `[n, layers, 2, kv_heads, block_tokens, head_dim]`
        on the CPU, bytes in hand)."""
        basis = self.basis if self.selector.needs_proj else None
        for i, key in enumerate(keys):
            got = self.index.peek(key)  # not a lookup: the store thread checks what it must summarise
            if got is None or not got.keeps(self.parts, basis):
                self.index.add(key, byte_view(payload[i]), self._kv_layout, basis)

    def generate(self, input_ids: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        """`connector.generate(...)` with sparse decode; the model's attention
        implementation is switched for the call and restored after."""
        with self.decoding():
            return self.connector.generate(input_ids, attention_mask, **kwargs)

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """The forward passes of this thread inside are decoded sparsely by
        this decoder (the model's attention switched, a session active), and
        its figures counted when it ends. Inside another decoder's `decoding`
        it does nothing: the outer one decodes (a hand-made decoder over a
        connector that has its own)."""
        if _ACTIVE.get() is not None:
            yield
            return
        model = self.connector.model
        before = getattr(model.config, "_attn_implementation", None) or "eager"
        session = _Session(self)
        counted = dict(self.counters)
        model.set_attn_implementation(impl_name(self.config.base))
        token = _ACTIVE.set(session)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            model.set_attn_implementation(before)
            fetched = session.close()
            self._merge(fetched)
            self.sparse.record(_figures({k: v - counted[k] for k, v in self.counters.items()}, fetched))

    def stats(self) -> dict[str, Any]:
        """Counters over every generate call so far (fetch counters added when a call returns)."""
        out = dict(self.counters)
        out.update(self._fetch)
        steps = max(1, out["decode_steps"])
        out["bytes_read_per_token"] = {t: b / steps for t, b in out.get("bytes_read", {}).items()}
        out["index"] = self.index.counters()
        return out

    def _merge(self, counters: dict[str, Any]) -> None:
        for k, v in counters.items():
            if isinstance(v, dict):
                d = self._fetch.setdefault(k, {})
                for t, b in v.items():
                    d[t] = d.get(t, 0) + b
            else:
                self._fetch[k] = self._fetch.get(k, 0) + v


def _figures(counts: Mapping[str, Any], fetched: Mapping[str, Any]) -> dict[str, float]:
    """One call's figures as the accelerator records them: numbers by name,
    the bytes read per tier as `bytes_read_<tier>`."""
    out = dict(counts)
    for k, v in fetched.items():
        if isinstance(v, dict):
            out.update({f"{k}_{t}": b for t, b in v.items()})
        else:
            out[k] = v
    return out


@dataclass(slots=True, eq=False)
class _LayerState:
    selection: Selection
    fetched: FetchedPages
    resident: torch.Tensor  # positions kept from the layer's tensors, as of the selection
    n_tokens: int  # context length at the selection
    step: int


class _Session:
    """One generate call's sparse state: per layer its current selection and fetched pages."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.d = decoder
        self.step = -1
        self.forwards = 0  # forwards begun (the first is the prefill)
        self.layers: dict[int, _LayerState] = {}
        self._units: dict[int, Any] = {}  # layer -> UnitSummaries of the prefix
        self._ready = False
        self._fetcher: Optional[PageFetcher] = None
        self._summaries: list = []  # the prompt's block summaries, in order

    def close(self) -> dict[str, Any]:
        """The call is over: its fetch counters (for the decoder's `stats`)."""
        return self._fetcher.counters.as_dict() if self._fetcher is not None else {}

    # ---- per step and layer ---------------------------------------------------
    def attend(self, dense: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
        d, c = self.d, self.d.counters
        layer = int(getattr(module, "layer_idx", 0))
        if layer == 0:
            self.forwards += 1
        if self.forwards == 1 or query.shape[2] != 1:  # the prefill (of one token after a full hit too): dense
            return dense(module, query, key, value, mask, **kwargs)
        if layer == 0:
            self.step += 1
            c["decode_steps"] += 1
        n = key.shape[2]
        try:
            cache = self._cache()
            if cache is None or query.shape[0] != 1 or not self._prepare(cache):
                c["dense_layer_steps"] += 1
                return dense(module, query, key, value, mask, **kwargs)
            st = self.layers.get(layer)
            if st is None or self.step - st.step >= d.options.reselect_every:
                st = self._select(layer, query, key, n, kwargs.get("scaling"))
            if st is None:  # a page could not be fetched: dense for this step
                c["dense_fallbacks"] += 1
                return dense(module, query, key, value, mask, **kwargs)
            res = torch.cat([st.resident, torch.arange(st.n_tokens, n, dtype=torch.int64)])
            pos = torch.cat([res, st.fetched.positions])
            order = torch.argsort(pos)
            pos = pos[order]
            dev = key.device
            o = order.to(dev)
            ks = torch.cat([key[:, :, res.to(dev)], st.fetched.keys.unsqueeze(0).to(dev)], dim=2)[:, :, o]
            vs = torch.cat([value[:, :, res.to(dev)], st.fetched.values.unsqueeze(0).to(dev)], dim=2)[:, :, o]
            m = None
            if mask is not None:
                if mask.shape[-1] < n:
                    c["dense_layer_steps"] += 1
                    return dense(module, query, key, value, mask, **kwargs)
                m = mask[..., pos.to(mask.device)]
        except Exception:
            log.warning("ucm sparse: layer %d step %d failed; attended densely", layer, self.step, exc_info=True)
            c["dense_fallbacks"] += 1
            self.layers.pop(layer, None)
            return dense(module, query, key, value, mask, **kwargs)
        c["sparse_layer_steps"] += 1
        c["attended_tokens"] += int(pos.shape[0])
        c["context_tokens"] += n
        if d.trace is not None:
            d.trace.append((self.step, layer, pos.tolist()))
        return dense(module, query, ks, vs, m, **kwargs)

    def _cache(self) -> Optional["UCMCache"]:
        from ucm.connectors.transformers.request_cache import UCMCache

        cache = self.d.connector.generating
        return cache if isinstance(cache, UCMCache) else None

    def _prepare(self, cache: "UCMCache") -> bool:
        """Once per session: the prompt's blocks stored, summaries for each,
        the fetcher. False: this request is decoded densely."""
        if self._ready:
            return self._fetcher is not None
        self._ready = True
        d, conn = self.d, self.d.connector
        rows = cache.rows
        if len(rows) != 1 or not rows[0].valid or rows[0].pad or not rows[0].keys:
            return False
        conn.wait_stores(d.config.wait_stores_s)
        r = rows[0]
        bt = conn.layout.block_tokens
        basis = None
        if d.selector.needs_proj:
            if d.basis is None:  # the first prompt: its full blocks' resident keys
                end = len(r.keys) * bt
                d.basis = fit_key_basis([ly.keys[0, :, :end].float().cpu().numpy() for ly in cache.layers],
                                        d.options.rank)
            basis = d.basis
        missing = [j for j, s in enumerate(d.index.get_many(r.keys)) if s is None or not s.keeps(d.parts, basis)]
        # restored blocks (and any the index forgot or summarised before the basis): from the resident
        # keys, the same bytes
        for j in missing:
            keys = torch.stack([ly.keys[0, :, j * bt:(j + 1) * bt] for ly in cache.layers]).float().cpu().numpy()
            d.index.put(r.keys[j], summarize_keys(keys, d.options.page_tokens, basis, d.parts))
            d.counters["summaries_from_layers"] += 1
        got = d.index.get_many(r.keys)
        if any(s is None or not s.keeps(d.parts, basis) for s in got):
            return False
        self._summaries = got
        self._fetcher = PageFetcher(conn.shared_cache, conn.layout, conn.dtype, d.options.page_tokens, r.keys,
                                    r.request_id)
        return True

    def _select(self, layer: int, query: torch.Tensor, key: torch.Tensor, n: int,
                scale: Optional[float]) -> Optional[_LayerState]:
        d = self.d
        pt = d.options.page_tokens
        units = self._units.get(layer)
        if units is None:
            units = self._units[layer] = layer_units(self._summaries, layer, pt,
                                                     d.basis if d.selector.needs_proj else None)
        q = query[0, :, 0, :].detach().float().cpu().numpy()
        keys = key[0].detach().float().cpu().numpy() if d.selector.needs_keys else None
        step = LayerStep(q, n, pt, key.shape[1], summaries=units, keys=keys, scale=scale)
        sel = d.selector.select(step, d.selection)
        d.counters["selections"] += 1
        prev = self.layers.get(layer)
        held = prev.fetched if prev is not None else None
        have = set(held.units) if held is not None else set()
        fresh = self._fetcher.fetch_pages(layer, [u for u in sel.units if u not in have])
        if fresh is None:
            self.layers.pop(layer, None)
            return None
        fetched = fresh if held is None else reuse_pages(held, fresh, sel.units, pt)
        d.counters["pages_reused"] += len(fetched.units) - len(fresh.units)
        picked = fetched.positions.numpy()
        mask = sel.mask()
        mask[picked] = False
        st = _LayerState(sel, fetched, torch.from_numpy(np.flatnonzero(mask).astype(np.int64)), n, self.step)
        self.layers[layer] = st
        return st
