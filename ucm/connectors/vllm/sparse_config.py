"""The settings of sparse decode in vLLM, read from `UCM_VLLM_SPARSE`.

Sparse decode is off unless the environment variable `UCM_VLLM_SPARSE`
asks for it; vLLM's processes (the front end, EngineCore, every worker)
inherit it, and the `vllm.general_plugins` entry point
(`ucm.connectors.vllm.sparse_plugin:register`) reads it in each of them.
Its value is a YAML (or JSON) mapping of the keys below, or `on` for the
defaults; unset, empty, `off` or `false` is off.

    UCM_VLLM_SPARSE='{selector: hybrid, budget: {tokens: 1024}, sink_tokens: 128, local_tokens: 256}'

- `selector`: `hybrid` (default), `lowrank`, `quest`, `blend`, `moment`, `mean`, `sinklocal`,
  `random`, `oracle`
  (ucm/accelerators/sparse/selectors.py; `oracle` reads every key of the
  context at every step: a measurement, not a saving); `lowrank` and
  `hybrid` also keep every token's key projected on a basis of `rank`
  directions per KV head, fitted by each layer on the first context it
  decodes sparsely;
- `budget`: one of `{tokens: n}` (default 1024), `{ratio: r}`, `{top_p: p}`
  (ucm/accelerators/sparse/base.py): tokens picked on top of sink, local
  window and tail;
- `sink_tokens` (128), `local_tokens` (256): always attended;
- `page_tokens` (16): the unit scored and picked, a divisor of vLLM's
  block size (128 on CPU);
- `min_context_tokens` (1024): decode rows with a shorter context go to
  the stock kernel; with `lowrank` or `hybrid`, at least `rank + page_tokens` (its
  basis is fitted on the full pages of a layer's first sparse context);
- `reselect_every` (1): a row's selection is held for this many steps
  (the tokens decoded meanwhile are attended too) before the selector
  scores again, as in the transformers path.
- `rank` (16): the basis rank of `lowrank` and `hybrid`, at most the model's head size.

Bad values raise `ConfigError` naming `UCM_VLLM_SPARSE.<key>` and what is
allowed. Pure data: no vLLM or torch import here.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ucm.accelerators.sparse.base import BUDGET_KINDS, Budget, SelectionConfig
from ucm.accelerators.sparse.selectors import SELECTORS
from ucm.config.validation import describe_validation_error
from ucm.errors import ArgumentError, ConfigError

ENV_SPARSE = "UCM_VLLM_SPARSE"
_OFF = (None, False, "", "off", "0", 0)


class VllmSparseConfig(BaseModel):
    """What sparse decode in vLLM does (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    selector: str = "hybrid"
    budget: Budget = Budget.tokens(1024)
    sink_tokens: int = Field(default=128, ge=0)
    local_tokens: int = Field(default=256, ge=0)
    page_tokens: int = Field(default=16, gt=0)
    reselect_every: int = Field(default=1, ge=1)
    rank: int = Field(default=16, ge=1)
    # After selector, page_tokens and rank: its check reads them.
    min_context_tokens: int = Field(default=1024, ge=0)

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

    def selection(self) -> SelectionConfig:
        return SelectionConfig(self.budget, self.sink_tokens, self.local_tokens)

    @field_validator("min_context_tokens")
    @classmethod
    def _basis_context(cls, v: int, info: ValidationInfo) -> int:
        """A selector that fits a key basis (`lowrank`, `hybrid`) must not fit it on a
        context with fewer than `rank` tokens in full pages: refused here,
        so a config built by hand is checked as one read from the
        environment is."""
        sel, rank, page = (info.data.get(k) for k in ("selector", "rank", "page_tokens"))
        if sel in SELECTORS and rank is not None and page is not None and SELECTORS[sel].needs_proj \
                and v < rank + page:
            raise ValueError(f"{v} is below rank + page_tokens ({rank} + {page}); selector {sel!r} fits its "
                             f"basis on the full pages of a layer's first sparse context; use at least "
                             f"{rank + page}")
        return v

    def check_block_size(self, block_tokens: int) -> None:
        """ConfigError unless `page_tokens` divides vLLM's block size."""
        if block_tokens % self.page_tokens:
            raise ConfigError(f"{ENV_SPARSE}.page_tokens: {self.page_tokens} does not divide vLLM's block size "
                              f"{block_tokens}; use a divisor of it such as 16 or 32")


def parse_sparse(value: Optional[str]) -> Optional[VllmSparseConfig]:
    """The settings in one value of `UCM_VLLM_SPARSE`; None when it says off."""
    if value is None or value.strip() == "":
        return None
    try:
        raw = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise ConfigError(f"{ENV_SPARSE}: the value is not valid YAML: {exc}") from None
    if raw in _OFF:
        return None
    if raw is True or raw == "on" or raw == 1:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV_SPARSE}: expected a mapping of {sorted(VllmSparseConfig.model_fields)}, "
                          f"or on / off, got {value!r}")
    try:
        cfg = VllmSparseConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, VllmSparseConfig, prefix=f"{ENV_SPARSE}.")) from None
    return cfg


def sparse_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[VllmSparseConfig]:
    """The settings of this process's `UCM_VLLM_SPARSE`, or None (off)."""
    env = os.environ if environ is None else environ
    return parse_sparse(env.get(ENV_SPARSE))
