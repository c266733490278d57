"""The per-step plan the scheduler side builds and vLLM ships to every
worker (pickled across the process boundary): which blocks to load into
which pages, which pages to save as which blocks, which requests were
preempted, and which prompts to blend. Plain values; nothing here runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ucm.api import Key
from ucm.connectors.kv_pages import SKIP

__all__ = ["SKIP", "BlendJob", "LoadJob", "StoreJob", "UCMConnectorMetadata"]


@dataclass(slots=True)
class LoadJob:
    """Copy `keys` into the request's pages. `page_ids[i]` lists the vLLM
    pages of block i in order; SKIP marks pages vLLM already computed.
    `is_async`: run in the background and report the request through
    get_finished (what get_num_new_matched_tokens told vLLM). `stream`
    (synchronous loads only): streamed layer by layer under the forward
    (`wait_for_layer_load`), not copied whole before it. `wait_s`
    (asynchronous loads only): how long to wait for blocks another engine
    is still committing (P/D, pd.py) before copying them."""

    req_id: str
    keys: list[Key]
    page_ids: list[list[int]]
    is_async: bool
    stream: bool = False
    wait_s: float = 0.0


@dataclass(slots=True)
class StoreJob:
    """Save the pages of consecutive full blocks `keys` (parent of keys[0]
    is `parent`)."""

    req_id: str
    keys: list[Key]
    page_ids: list[list[int]]
    parent: Optional[Key]


@dataclass(slots=True)
class BlendJob:
    """Blend the request's first `len(tokens)` tokens into its `page_ids`
    before the forward (blend.py): the tokens from `start` (vLLM's own hit)
    to the first chunk computed, each chunk in `spans` read from the
    entries `keys[i]` (whole blocks of `block_tokens`; computed and stored
    where missing), rotated into place, and a share recomputed (the engine's
    blend options with the request's `options`; under `select: question`,
    the share the `question`'s tokens attend to most)."""

    req_id: str
    tokens: list[int]
    spans: list[tuple[int, int]]
    keys: list[list[Key]]
    block_tokens: int
    page_ids: list[int]
    start: int
    options: dict = field(default_factory=dict)  # the request's own blend options over the engine's
    question: list[int] = field(default_factory=list)  # the prompt's tokens after the blended part (vLLM's to compute)

    def blended_pages(self, page_tokens: int) -> list[int]:
        """The pages the blend writes (from vLLM's own hit to the end)."""
        return self.page_ids[self.start // page_tokens:-(-len(self.tokens) // page_tokens)]


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    blends: list[BlendJob] = field(default_factory=list)
