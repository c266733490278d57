"""BlendAccelerator: a prompt's chunks (retrieved passages) reused wherever
they sit, with a share of their tokens recomputed so that they attend to
each other again (CacheBlend, Yao et al. 2025; EPIC, Hu et al. 2024).

    accelerators:
      - name: blend
        options: {select: deviation, ratio: 0.15}

It runs in the engine's process (`runs_in = "engine"`): the recompute is a
forward pass. The transformers connector takes it by type and blends the
`generate` calls that declare chunks
(ucm/connectors/transformers/blend.py); vLLM's UCMConnector reads its
options and blends the requests whose `kv_transfer_params` declare
`ucm_chunks` (ucm/connectors/vllm/blend.py; a request may override them
with `ucm_blend`); without the entry, both blend with the defaults below.

Options (`BlendOptions`; a bad one is a ConfigError naming
`accelerators.<i>.options.<key>`):
- `select`: which chunk tokens are recomputed in every layer:
  - `deviation` (default): the first `check_layers` layers are computed for
    every chunk token; the `ratio` of chunk tokens whose K/V at layer
    `check_layers` deviate most from the reused K/V are recomputed in the
    layers after it (CacheBlend's selection);
  - `question`: the `ratio` of chunk tokens that the prompt's tokens after
    its last chunk (the question) attend to most over the reused KV, in
    the layers from `question_from_layer` on, are recomputed in every
    layer; no layer is computed for every token (a forward of the
    question's tokens finds them);
  - `leading`: the first `leading_tokens` of each chunk, in every layer
    (EPIC's); no layer is computed for every token;
- `ratio` (0.15): the share of reused chunk tokens recomputed under
  `deviation` and `question`; 0 is plain concatenation (nothing
  recomputed, no layer computed for all), 1 the full prefill;
- `leading_tokens` (16): under `leading`;
- `check_layers` (1): under `deviation`, at least 1;
- `question_from_layer` (none: half the model's layers): under `question`,
  the first layer whose attention counts (the last layer where it is
  past it);
- `anchor_tokens` (0): under `deviation` and `question`, each passage's
  first tokens recomputed before the criterion picks the rest of the
  ratio's budget;
- `context`: what a chunk's entry is computed after:
  - `prefix` (default): the prompt's tokens before its first chunk (the
    system prompt), so that a chunk never holds the attention sink of a
    sequence's first token; its entries serve prompts that begin with the
    same prefix;
  - `none`: nothing (alone at position 0): entries serve any prompt.
Tokens that no cached chunk covers (text between chunks, the part of a
chunk after its last whole block) are always computed in every layer.

Counters (`record` from the connector): blended requests, chunks read from
the cache and chunks computed alone, tokens reused and recomputed.

Thread safety: `record` and `counters` may be called from any thread.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field, ValidationInfo, field_validator

from ucm.accelerators.base import AcceleratorOptions, EngineAccelerator

SELECTS = ("deviation", "question", "leading")
CONTEXTS = ("prefix", "none")


class BlendOptions(AcceleratorOptions):
    """How chunks are blended (module docstring)."""

    select: str = "deviation"
    ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    leading_tokens: int = Field(default=16, ge=0)
    check_layers: int = Field(default=1, ge=1)
    question_from_layer: Optional[int] = Field(default=None, ge=0)
    anchor_tokens: int = Field(default=0, ge=0)
    context: str = "prefix"

    @field_validator("select", "context")
    @classmethod
    def _one_of(cls, v: str, info: ValidationInfo) -> str:
        allowed = {"select": SELECTS, "context": CONTEXTS}[info.field_name]
        if v not in allowed:
            raise ValueError(f"unknown {info.field_name} {v!r}; allowed: {list(allowed)}")
        return v


class BlendAccelerator(EngineAccelerator):
    """Chunk blending's settings and figures in one engine process (module
    docstring)."""

    name = "blend"
    Config = BlendOptions
    options: BlendOptions
