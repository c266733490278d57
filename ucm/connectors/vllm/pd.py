"""Prefill/decode disaggregation through ucm: the `kv_transfer_params` a
prefill engine returns and a decode engine reads (vLLM's P/D convention,
as its NIXL and Mooncake connectors use it).

The proxy (`ucm pd-proxy`, ucm/apps/pd_proxy.py) sends a request first to a
prefill engine with `kv_transfer_params: {"do_remote_decode": true}` and
`max_tokens` 1. That engine's connector (role kv_producer or kv_both)
saves the prompt's full blocks after the forward that wrote them, as for
any request, and returns with the finished request

    {"do_remote_prefill": true, "do_remote_decode": false,
     "ucm_blocks": ["<key in hex>", ...], "remote_num_tokens": N}

the keys of the blocks in prompt order and the N tokens they cover. The
proxy sends the original request to a decode engine with these params. Its
connector (kv_consumer or kv_both) checks that they are its own keys of the
same prompt (same model, namespace, salt and LoRA), claims them as an
asynchronous load, and its worker waits for each to be committed (at most
`ucm_pd_wait_s`) before copying it; a block that does not come is a load
error, which vLLM recomputes. So the decode engine never reads a block the
prefill engine has not committed, and computes only the last partial block
when all came. Params that are malformed or name other blocks are a
TransferParamsWarning, and the request is served as a plain one.
"""
from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from vllm.v1.request import RequestStatus

from ucm.api import Key
from ucm.errors import TransferParamsWarning

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ucm.connectors.vllm.request_state import ReqState

log = logging.getLogger(__name__)

BLOCKS = "ucm_blocks"  # the key under which a prefill engine names its blocks


FINISHED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


# ---- a request's P/D part, as the scheduler side (scheduler.py) drives it ------------
def begin(st: "ReqState", params: Any, request_id: str, can_load: bool, can_save: bool) -> None:
    """Reads a new request's P/D part from its `kv_transfer_params` into
    `st`: whether it prefills for a decode engine, and on a decode engine
    the prefill engine's blocks it may claim."""
    st.pd_producer = can_save and wants_blocks(params)
    if can_load:
        st.pd_decode = isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))
        st.pd_named = named_blocks(params, st.keys, request_id)


def claim(st: "ReqState", num_tokens: int, num_computed_tokens: int, block_tokens: int) -> int:
    """The decode step's claim: the named blocks beyond vLLM's own hit, as
    tokens of one asynchronous load (whose worker waits for the blocks
    still being committed); the prefill engine saves them, this one does not."""
    hit = min(st.pd_named * block_tokens, num_tokens - 1)
    st.external_tokens = max(0, hit - num_computed_tokens)
    if st.external_tokens:
        st.next_store = max(st.next_store, st.pd_named)
        st.load_async, st.load_stream = True, False
    return st.external_tokens


def finish(st: "ReqState", request: "Request", block_tokens: int) -> Optional[dict[str, Any]]:
    """At the request's end: the decode step's line (what it loaded and
    computed), and the prefill step's params for the decode engine."""
    if st.pd_decode:
        prompt = request.num_prompt_tokens
        log.info("UCMConnector: P/D request %s: %d prompt tokens, %d loaded through ucm, %d computed here",
                 request.request_id, prompt, st.external_tokens, prompt - st.local_tokens - st.external_tokens)
    if st.pd_producer and request.status in FINISHED:  # saved (or planned) blocks, or found cached
        return producer_params(st.keys[:st.next_store], block_tokens)
    return None


# ---- the params ---------------------------------------------------------------------
def wants_blocks(params: Any) -> bool:
    """Whether a request asks this engine to prefill for a decode engine
    (`do_remote_decode`): its connector then returns `producer_params`."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def producer_params(keys: Sequence[Key], block_tokens: int) -> dict[str, Any]:
    """What a prefill engine returns: the blocks `keys` (the prompt's
    leading full blocks it saved or found cached) for a decode engine."""
    return {"do_remote_prefill": True, "do_remote_decode": False, BLOCKS: [k.hex() for k in keys],
            "remote_num_tokens": len(keys) * block_tokens}


def named_blocks(params: Any, keys: Sequence[Key], request_id: str) -> int:
    """How many leading blocks of the prompt (`keys`, this engine's own
    keys for it) a prefill engine's `params` name; 0 when the request is
    not a decode step of P/D or its params cannot be used (a
    TransferParamsWarning naming the request and the key)."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return 0
    named = params.get(BLOCKS)
    problem = _problem(named, keys)
    if problem is None:
        return len(named)
    msg = (f"request {request_id}: kv_transfer_params.{BLOCKS} {problem}; it is served as a plain request "
           f"(computing what this engine's cache does not hold)")
    log.warning("UCMConnector: %s", msg)
    warnings.warn(msg, TransferParamsWarning, stacklevel=2)
    return 0


def _problem(named: Any, keys: Sequence[Key]) -> Optional[str]:
    """What is wrong with `named` as the prompt's leading blocks, or None."""
    if not isinstance(named, list) or not all(isinstance(h, str) for h in named):
        return f"must be a list of block keys in hex, got {type(named).__name__} {named!r:.80}"
    if len(named) > len(keys):
        return f"names {len(named)} blocks, but the prompt has {len(keys)} full blocks"
    for i, (h, k) in enumerate(zip(named, keys)):
        if h != k.hex():
            return (f"block {i} ({h[:16]}...) is not this prompt's block under this engine's namespace "
                    f"(another model, prompt, salt or block size)")
    return None
