"""SparseAccelerator: sparse attention at decode, enabled in the YAML file
like any accelerator and reached by the connector that runs the attention.

    accelerators:
      - name: sparse
        options: {selector: hybrid, budget: {tokens: 1024}, sink_tokens: 128, local_tokens: 256}

It runs in the engine's process (`runs_in = "engine"`): the selection
happens inside the forward pass, per layer and decode step, where the
query is. The connector builds its process's engine-side accelerators and
takes this one by type:

    accs = Accelerators.build(config, cache, runs_in="engine")
    sparse = accs.get(SparseAccelerator)   # None: sparse decode is off

and then reads everything sparse decode is configured by from it:
`selection` (budget, sink and local window), `make_selector()` (a selector
of the configured kind; `random` keeps state, so one per caller),
`summary_parts()` (what the page summaries must keep for it),
`new_index()` (a SummaryIndex of `summary_capacity_bytes`), and the
checks against the engine's shapes (`check_block_tokens`,
`check_head_dim`). The connector reports its figures with `record`; they
are this accelerator's `counters()`.

Where it is used: the transformers connector builds it from its cache's
config and decodes its `generate` calls with it
(ucm/connectors/transformers/sparse.py); vLLM's sparse backend builds it
once per worker from the ucm config vLLM names, switched on, and its
options overridden, by `UCM_VLLM_SPARSE` (ucm/connectors/vllm/sparse_config.py).

Options (`SparseOptions`; a bad one is a ConfigError naming
`accelerators.<i>.options.<key>`):
- `selector`: one of ucm/accelerators/sparse/selectors.py's `SELECTORS`
  (default `hybrid`; `oracle` reads every key of the context at every step:
  a measurement, not a saving); `lowrank` and `hybrid` also keep every
  token's key projected on a basis of `rank` directions per KV head,
  fitted on the first context decoded sparsely;
- `budget`: one of `{tokens: n}` (default 1024), `{ratio: r}`, `{top_p: p}`
  (ucm/accelerators/sparse/base.py): tokens picked on top of sink, local
  window and tail;
- `sink_tokens` (128), `local_tokens` (256): always attended;
- `page_tokens` (16): the unit scored and picked; a divisor of the cache's
  `block_tokens` and of the engine's page size;
- `reselect_every` (1): a selection is held for this many steps before the
  selector scores again;
- `rank` (16): the basis rank of the selectors that read projected keys, at
  most the model's head size;
- `min_context_tokens` (1024): shorter decode contexts are attended
  densely (vLLM's backend; the transformers decoder decodes every context
  sparsely); with a selector that fits a basis, at least `rank + page_tokens`;
- `summary_capacity_bytes` (256MiB): the memory of a `new_index()` (the
  transformers decoder's; vLLM keeps its summaries beside its KV blocks).

Thread safety: `record` and `counters` may be called from any thread; the
rest reads frozen settings.
"""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field, ValidationInfo, field_validator

from ucm.accelerators.base import AcceleratorOptions, CacheSettings, EngineAccelerator
from ucm.accelerators.sparse.base import BUDGET_KINDS, Budget, SelectionConfig, Selector
from ucm.accelerators.sparse.index import SummaryIndex
from ucm.accelerators.sparse.selectors import SELECTORS, make_selector
from ucm.accelerators.sparse.summaries import SummaryParts
from ucm.config.sizes import positive_size
from ucm.errors import ArgumentError, ConfigError


class SparseOptions(AcceleratorOptions):
    """What sparse decode does (module docstring)."""

    selector: str = "hybrid"
    budget: Budget = Budget.tokens(1024)
    sink_tokens: int = Field(default=128, ge=0)
    local_tokens: int = Field(default=256, ge=0)
    page_tokens: int = Field(default=16, gt=0)
    reselect_every: int = Field(default=1, ge=1)
    rank: int = Field(default=16, ge=1)
    # After selector, page_tokens and rank: its check reads them.
    min_context_tokens: int = Field(default=1024, ge=0)
    summary_capacity_bytes: int = 256 << 20

    @field_validator("selector")
    @classmethod
    def _selector(cls, v: str) -> str:
        if v not in SELECTORS:
            raise ValueError(f"unknown selector {v!r}; allowed: {sorted(SELECTORS)}")
        return v

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> Budget:
        if isinstance(v, Budget):
            return v
        if not isinstance(v, Mapping) or len(v) != 1 or next(iter(v)) not in BUDGET_KINDS:
            raise ValueError(f"must be a mapping with one key of {list(BUDGET_KINDS)}, e.g. {{tokens: 1024}}, "
                             f"got {v!r}")
        kind, value = next(iter(v.items()))
        try:
            return Budget(kind, value)
        except ArgumentError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("min_context_tokens")
    @classmethod
    def _basis_context(cls, v: int, info: ValidationInfo) -> int:
        """A selector that fits a key basis must not fit it on a context
        with fewer than `rank` tokens in full pages."""
        sel, rank, page = (info.data.get(k) for k in ("selector", "rank", "page_tokens"))
        if sel in SELECTORS and rank is not None and page is not None and SELECTORS[sel].needs_proj \
                and v < rank + page:
            raise ValueError(f"{v} is below rank + page_tokens ({rank} + {page}); selector {sel!r} fits its "
                             f"basis on the full pages of a layer's first sparse context; use at least "
                             f"{rank + page}")
        return v

    @field_validator("summary_capacity_bytes", mode="before")
    @classmethod
    def _capacity(cls, v: Any) -> int:
        return positive_size(v)


class SparseAccelerator(EngineAccelerator):
    """Sparse attention's settings and figures in one engine process
    (module docstring)."""

    name = "sparse"
    Config = SparseOptions
    options: SparseOptions

    def __init__(self, cache: Any, config: CacheSettings, **options: Any) -> None:
        super().__init__(cache, config, **options)
        opts = self.options
        if config.block_tokens % opts.page_tokens:
            raise ConfigError(f"accelerator 'sparse': options.page_tokens {opts.page_tokens} does not divide "
                              f"block_tokens {config.block_tokens}; use a divisor of it such as 16 or 32")
        self.selection = SelectionConfig(opts.budget, opts.sink_tokens, opts.local_tokens)

    # ---- what the connector builds sparse decode from ------------------------------
    def make_selector(self) -> Selector:
        """A new selector of the configured kind."""
        return make_selector(self.options.selector)

    def summary_parts(self) -> SummaryParts:
        """The page summaries the configured selector reads."""
        return SummaryParts.of(self.make_selector())

    def new_index(self) -> SummaryIndex:
        """An empty SummaryIndex of `summary_capacity_bytes` over pages of
        `page_tokens`, keeping `summary_parts()`."""
        o = self.options
        return SummaryIndex(o.summary_capacity_bytes, o.page_tokens, self.summary_parts())

    def check_block_tokens(self, block_tokens: int) -> None:
        """ConfigError unless `page_tokens` divides the engine's block (or
        page) of `block_tokens` tokens."""
        if block_tokens % self.options.page_tokens:
            raise ConfigError(f"accelerator 'sparse': options.page_tokens {self.options.page_tokens} does not "
                              f"divide the engine's block size {block_tokens}; use a divisor of it such as 16 "
                              f"or 32")

    def check_head_dim(self, head_dim: int) -> None:
        """ConfigError when the selector reads projected keys and `rank` is
        above the model's head size."""
        o = self.options
        if SELECTORS[o.selector].needs_proj and o.rank > head_dim:
            raise ConfigError(f"accelerator 'sparse': options.rank {o.rank} must be at most the model's head "
                              f"size {head_dim}")

