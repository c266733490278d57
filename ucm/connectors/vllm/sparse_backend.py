"""UcmSparseCpuBackend: vLLM's CPU attention backend with sparse decode rows.

vLLM for CPU always takes the backend `CPU_ATTN`; the plugin
(sparse_plugin.py) points `CPU_ATTN`'s class path here when
`UCM_VLLM_SPARSE` asks for sparse decode, and only then. Its settings are
the `sparse` accelerator's (SparseAccelerator), built once per process
from the ucm config vLLM's current config names (its
`kv_transfer_config.kv_connector_extra_config["ucm_config"]`, else
$UCM_CONFIG or the defaults, as UCMConnector loads it) with
`UCM_VLLM_SPARSE`'s keys over its `sparse` entry (sparse_config.py). The
backend is the stock one (`CPUAttentionBackend`: its name, metadata builder, KV
layout and kernels) with one impl per attention layer that, at each
forward:

- decode rows (one query token) whose context is at least
  `min_context_tokens` are attended sparsely: the layer's page summaries
  (sparse_pages.PageSummaries, 16-token pages inside vLLM's 128-token
  blocks, refreshed from the KV cache when vLLM wrote a page) are scored
  with the row's query by ucm's selector (`hybrid` by default: `lowrank`
  scores every token from its key projected on a basis the layer fits on
  the first context it decodes sparsely, `hybrid` adds quest's best
  pages), sink, local window and tail are
  kept, pages are picked within the budget, and the
  row attends in torch, float32, over exactly the selected tokens gathered
  from the paged KV (sparse_pages.gather_tokens / attend); with
  `reselect_every` s > 1 a row's selection is held for s steps and the
  tokens decoded meanwhile are added to it (sparse_pages.HeldSelections,
  reused only while the held pages are unchanged);
- every other row (prefill, short contexts) goes to the stock kernel
  (`ops.cpu_attention_with_kv_cache`), the whole batch at once when no row
  is sparse (the stock forward, unchanged), or the stock rows alone with
  their own scheduler metadata in a mixed batch;
- layers the sparse path does not cover (sliding window, ALiBi, soft cap,
  attention sinks, fp8 KV, encoder attention) and kernels whose KV layout
  it does not read (any ISA but `vec`: AMX with bfloat16, NEON, vec16)
  always use the stock kernel.

Gather, not a reduced block table: the CPU kernel addresses KV in whole
blocks (its block size is a multiple of 32 tokens, 128 by default), so a
reduced block table can only drop whole 128-token blocks; picking 16-token
pages (what the issue's calibration measured: 0.963 vs 0.911 of the
attention mass at the same budget) needs the tokens gathered.

vLLM still allocates and writes every page: the gain is the bandwidth and
compute of decode attention, not KV capacity. Nothing here raises into
vLLM on the forward path: a sparse row that fails is logged and the whole
layer step is recomputed by the stock kernel.

Runs in the worker process's model thread (the impls are made while vLLM
builds the model, under its current config). `counters()` answers this
process's figures (read by tests through `LLM.collective_rpc`).
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ucm.accelerators.sparse import LayerStep, SparseAccelerator, fit_key_basis
from ucm.config.schema import ENV_CONFIG, load_config
from ucm.connectors.vllm.sparse_config import ENV_SPARSE, sparse_accelerator
from ucm.connectors.vllm.sparse_pages import (HeldSelections, PageSummaries, attend, context_keys, gather_tokens,
                                              range_positions, vec_kv_views)
from ucm.errors import ConfigError

log = logging.getLogger(__name__)

BACKEND_PATH = "ucm.connectors.vllm.sparse_backend.UcmSparseCpuBackend"
VEC_ISA = "vec"  # the CPU kernel whose KV layout sparse_pages.vec_kv_views reads

_COUNTERS: dict[str, int] = {
    "sparse_layer_rows": 0,  # (layer, decode row) pairs attended over a selection
    "stock_layer_rows": 0,  # (layer, row) pairs sent to the stock kernel
    "attended_tokens": 0,  # tokens attended by the sparse rows, summed
    "context_tokens": 0,  # their contexts' tokens, summed
    "pages_summarized": 0,
    "fallbacks": 0,  # sparse layer steps that failed and ran the stock kernel
    "selections": 0,  # sparse (layer, row) pairs that scored and picked
    "selections_reused": 0,  # ... that attended a held selection (`reselect_every`)
    "bases_fitted": 0,  # layers that fitted `lowrank`'s key basis
}


def counters() -> dict[str, int]:
    """This process's sparse decode figures (module docstring)."""
    return dict(_COUNTERS)


def reset_counters() -> None:
    for k in _COUNTERS:
        _COUNTERS[k] = 0


# The process's accelerator, by what it was built from (UCM_VLLM_SPARSE, $UCM_CONFIG, the ucm_config vLLM names):
# every layer's impl shares one, built once (loading the config and the entry points is not per layer work).
_BUILT: dict[tuple[Optional[str], Optional[str], str], Optional[SparseAccelerator]] = {}


def process_accelerator() -> Optional[SparseAccelerator]:
    """The SparseAccelerator of this worker (module docstring), or None
    when `UCM_VLLM_SPARSE` is off."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    transfer = vllm_config.kv_transfer_config if vllm_config is not None else None
    source = (transfer.kv_connector_extra_config or {}).get("ucm_config") if transfer is not None else None
    key = (os.environ.get(ENV_SPARSE), os.environ.get(ENV_CONFIG), repr(source))
    if key not in _BUILT:
        _BUILT[key] = sparse_accelerator(load_config(source)) if key[0] is not None else None
    return _BUILT[key]


class UcmSparseCpuBackend(CPUAttentionBackend):
    """`CPU_ATTN` with sparse decode rows; everything but the impl is the stock backend's."""

    @staticmethod
    def get_impl_cls() -> type["UcmSparseCpuImpl"]:
        return UcmSparseCpuImpl


@dataclass(frozen=True, slots=True)
class _Plan:
    """One step's rows, shared by the layers of the step (_StepPlans)."""

    sparse: tuple[int, ...]  # decode rows attended sparsely
    stock: tuple[int, ...]  # rows for the stock kernel
    prefill: tuple[int, ...]  # rows with more than one query token
    starts: tuple[int, ...]  # query_start_loc
    seq_lens: tuple[int, ...]


class _StepPlans:
    """The plan of the step whose metadata was seen last: the layers of one
    step share one metadata object, so they share its plan. Kept here, keyed
    by a weak reference to vLLM's metadata object, instead of written onto
    that object: CPUAttentionMetadata has no field for a backend's own data.
    Worker's model thread only."""

    def __init__(self) -> None:
        self._md: Optional[weakref.ReferenceType] = None
        self._plan: Optional[_Plan] = None

    def get(self, md: CPUAttentionMetadata) -> Optional[_Plan]:
        """The plan made for `md`, or None (a new step)."""
        return self._plan if self._md is not None and self._md() is md else None

    def put(self, md: CPUAttentionMetadata, plan: _Plan) -> None:
        self._md, self._plan = weakref.ref(md), plan


_STEP_PLANS = _StepPlans()


class UcmSparseCpuImpl(CPUAttentionBackendImpl):
    """The stock CPU impl, with sparse decode rows (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sparse = process_accelerator()
        if sparse is None:
            raise ConfigError(f"{BACKEND_PATH} is in use but {ENV_SPARSE} is off; the plugin registers it only "
                              f"when {ENV_SPARSE} asks for sparse decode")
        self.sparse = sparse
        self.options = sparse.options
        self.selector = sparse.make_selector()
        sparse.check_head_dim(self.head_size)
        self._selection = sparse.selection
        self.summaries: Optional[PageSummaries] = None
        self.held: Optional[HeldSelections] = None
        self.covered = (self.attn_type == AttentionType.DECODER and self.alibi_slopes is None
                        and not self.logits_soft_cap and self.sinks is None and self.sliding_window == -1
                        and not self.is_fp8_kv_cache)

    # ---- writes ----------------------------------------------------------------------
    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.covered:
            s = self._summaries(kv_cache)
            if s is not None:
                s.mark_written(slot_mapping[:key.shape[0]])

    def _summaries(self, kv_cache: torch.Tensor) -> Optional[PageSummaries]:
        if kv_cache.dim() != 4 or kv_cache.numel() == 0:
            return None
        nb, heads, bt, _ = kv_cache.shape
        s = self.summaries
        if s is None or (s.num_blocks, s.kv_heads, s.block_tokens) != (nb, heads, bt):
            self.sparse.check_block_tokens(bt)
            parts = self.sparse.summary_parts()
            s = self.summaries = PageSummaries(nb, heads, bt, self.head_size, self.options.page_tokens,
                                               keep_bounds=parts.bounds, keep_mean=parts.mean)
            self.held = HeldSelections(self.options.reselect_every, bt, self.options.page_tokens)
        return s

    # ---- forward ---------------------------------------------------------------------
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[CPUAttentionMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        stock = (attn_metadata is None or not self.covered or getattr(layer, "isa", None) != VEC_ISA
                 or output_scale is not None
                 or output_block_scale is not None or not attn_metadata.causal
                 or attn_metadata.dynamic_causal is not None or attn_metadata.encoder_cache is not None)
        summaries = None if stock else self._summaries(kv_cache)
        if self.held is not None:
            self.held.tick()
        if stock or summaries is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        plan = self._plan(attn_metadata)
        bt = attn_metadata.block_table
        for r in plan.prefill:  # its context may have been written behind the layer (prefix hit, connector load)
            summaries.mark_blocks(bt[r, :_blocks(plan.seq_lens[r], summaries.block_tokens)])
        if not plan.sparse:
            _COUNTERS["stock_layer_rows"] += len(plan.stock)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        key_cache, value_cache = vec_kv_views(kv_cache)
        before = summaries.pages_summarized
        try:
            if plan.stock:
                self._stock_rows(layer, query, key_cache, value_cache, attn_metadata, output, plan)
            rows = [self._sparse_row(summaries, query, key_cache, value_cache, bt[r], plan, r, output)
                    for r in plan.sparse]
        except Exception:
            log.warning("ucm sparse decode: a layer step failed; the stock kernel attends it", exc_info=True)
            _COUNTERS["fallbacks"] += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        _COUNTERS["pages_summarized"] += summaries.pages_summarized - before
        _COUNTERS["sparse_layer_rows"] += len(plan.sparse)
        _COUNTERS["stock_layer_rows"] += len(plan.stock)
        _COUNTERS["attended_tokens"] += sum(tokens for tokens, _ in rows)
        held = sum(1 for _, was_held in rows if was_held)
        _COUNTERS["selections_reused"] += held
        _COUNTERS["selections"] += len(rows) - held
        _COUNTERS["context_tokens"] += sum(plan.seq_lens[r] for r in plan.sparse)
        return output

    def _plan(self, md: CPUAttentionMetadata) -> _Plan:
        plan = _STEP_PLANS.get(md)
        if plan is None:
            starts = tuple(int(x) for x in md.query_start_loc.tolist())
            seq_lens = tuple(int(x) for x in md.seq_lens.tolist())
            q_lens = [starts[i + 1] - starts[i] for i in range(len(seq_lens))]
            floor = self.options.min_context_tokens
            sparse = tuple(i for i, q in enumerate(q_lens) if q == 1 and seq_lens[i] >= max(1, floor))
            stock = tuple(i for i in range(len(seq_lens)) if i not in set(sparse))
            plan = _Plan(sparse, stock, tuple(i for i, q in enumerate(q_lens) if q > 1), starts, seq_lens)
            _STEP_PLANS.put(md, plan)
        return plan

    def _sparse_row(self, summaries: PageSummaries, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_row: torch.Tensor, plan: _Plan, r: int, output: torch.Tensor) -> tuple[int, bool]:
        """Attends row r's one query token over its selection (a held one,
        or picked now); the tokens attended and whether the selection was held."""
        n, t = plan.seq_lens[r], plan.starts[r]
        q = query[t]  # [q_heads, head_dim], after RoPE
        held = self.held
        pos = held.find(summaries, block_row, n) if held is not None else None
        reused = pos is not None
        if pos is None:
            if self.selector.needs_proj and summaries.basis is None:  # the layer's first sparse context
                self._fit_basis(summaries, key_cache, block_row, n)
            units = summaries.units(key_cache, block_row, n)
            keys = context_keys(key_cache, block_row, n) if self.selector.needs_keys else None
            step = LayerStep(q.detach().float().numpy(), n, self.options.page_tokens, key_cache.shape[1],
                             summaries=units, keys=keys, scale=self.scale)
            sel = self.selector.select(step, self._selection)
            pos = range_positions(sel.ranges)
            if held is not None:
                held.keep(summaries, block_row, n, pos)
        k = gather_tokens(key_cache, block_row, pos)
        v = gather_tokens(value_cache, block_row, pos)
        output[t] = attend(q, k, v, self.scale).to(output.dtype)
        return int(pos.numel()), reused

    def _fit_basis(self, summaries: PageSummaries, key_cache: torch.Tensor, block_row: torch.Tensor,
                   n: int) -> None:
        """`lowrank`'s basis for this layer, from the keys of the context's
        full pages (ucm/accelerators/sparse/lowrank.py), kept from now on."""
        full = n // summaries.page_tokens * summaries.page_tokens
        keys = context_keys(key_cache, block_row, full)
        summaries.set_basis(fit_key_basis([keys], self.options.rank).vectors[0])
        _COUNTERS["bases_fitted"] += 1

    def _stock_rows(self, layer: Any, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    md: CPUAttentionMetadata, output: torch.Tensor, plan: _Plan) -> None:
        """The stock kernel over the plan's stock rows only (their own query
        ranges, seq_lens, block table rows and scheduler metadata)."""
        rows = torch.tensor(plan.stock, dtype=torch.int64)
        idx = torch.cat([torch.arange(plan.starts[r], plan.starts[r + 1]) for r in plan.stock])
        q_lens = torch.tensor([plan.starts[r + 1] - plan.starts[r] for r in plan.stock], dtype=torch.int32)
        starts = torch.zeros(len(plan.stock) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=starts[1:])
        seq_lens = md.seq_lens[rows].contiguous()
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(plan.stock), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size, seq_lens=seq_lens, dtype=query.dtype, query_start_loc=starts,
            causal=md.causal, sliding_window_size=self.sliding_window, isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        out = torch.empty((idx.numel(),) + tuple(output.shape[1:]), dtype=output.dtype)
        ops.cpu_attention_with_kv_cache(
            query=query[idx].contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=starts, seq_lens=seq_lens, scale=self.scale, causal=md.causal,
            alibi_slopes=None, sliding_window=self.sliding_window, block_table=md.block_table[rows].contiguous(),
            softcap=0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            # vLLM 0.32 has no public form of the layer's KV scales: its own
            # AttentionLayer protocol declares `_k_scale_float` and
            # `_v_scale_float`, and the stock CPU impl reads them the same way.
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        output[idx] = out


def _blocks(n_tokens: int, block_tokens: int) -> int:
    return -(-n_tokens // block_tokens)
