"""ReqState: what the scheduler side (scheduler.py) keeps of one request,
from its first sight to `request_finished`, and the request's effective
settings (the engine's with its `kv_transfer_params` overrides). A plain
record; the state machine that moves it is the scheduler side's, with its
PrefetchPolicy (prefetch_policy.py) moving the staging fields."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ucm.api import Handle, Key
from ucm.connectors.vllm.settings import ConnectorSettings

MAX_LOAD_FAILURES = 2  # lost loads after which a request is computed without ucm


@dataclass(slots=True)
class ReqState:
    keys: list[Key]  # keys of the prompt's full blocks
    settings: ConnectorSettings = ConnectorSettings()  # the engine's, with the request's overrides
    hit_blocks: int = 0  # leading blocks the cache held at lookup (and blocks being saved after them)
    hit_tiers: list[Optional[str]] = field(default_factory=list)
    looked_up: bool = False
    pinned: list[Key] = field(default_factory=list)
    allocated: bool = False  # vLLM gave it pages (update_state_after_alloc); else it waits
    capped: bool = False  # its hit was cut at the waiting-pin cap: look up again when there is room
    local_tokens: int = 0  # vLLM's own (page-aligned) hit at the last lookup
    load_async: bool = False  # what the last lookup answered vLLM: both sides must agree
    load_stream: bool = False  # a synchronous load streamed layer by layer (load_choice)
    page_ids: list[int] = field(default_factory=list)  # the request's vLLM pages
    next_store: int = 0  # first block neither cached nor planned for saving
    stores_issued: bool = False
    load_failures: int = 0  # loads of this request that lost blocks
    staging: Optional[Handle] = None  # the prefetch of its blocks below the landing tier, in flight
    staging_since: float = 0.0  # monotonic time the staging was issued
    staging_deadline: float = 0.0  # monotonic time after which it is answered without waiting
    staging_losses: int = 0  # stagings that came back late (a short one is no loss)
    staging_tried: bool = False  # a staging was issued since the last fresh lookup
    unstaged: bool = False  # not staged (over the budget) or staged short: loaded as without a prefetch policy
    staged: frozenset = frozenset()  # the blocks its staging brought up (no charge to the waiting-pin cap)
    pin_charge: int = 0  # of its pins, those the waiting-pin cap counts (0 once allocated)
    room_since: float = 0.0  # monotonic time it began waiting for room under the cap; -1: waited once
    room_deadline: float = 0.0
    tokens: Optional[Any] = None  # the prompt's token ids, kept when the KV events describe its blocks
    extra: Optional[dict] = None  # and the context they are hashed with (kv_events.request_extra)
    pd_named: int = 0  # decode side of P/D: leading blocks a prefill engine named (pd.py), until a load lost some
    pd_producer: bool = False  # prefill side of P/D: its blocks are returned in kv_transfer_params
    pd_decode: bool = False  # decode side of P/D: its kv_transfer_params came from a prefill engine
    external_tokens: int = 0  # what the last lookup answered vLLM (0 once a load lost blocks)
    chunks: list = field(default_factory=list)  # blend: the declared chunk spans (blend_request.py), until declined
    blending: bool = False  # blend: its blended part is claimed; none of its blocks is saved
    blend_options: dict = field(default_factory=dict)  # blend: the request's own options over the engine's
