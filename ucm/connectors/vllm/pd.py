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
from typing import Any, Mapping, Optional, Sequence

from ucm.api import Key
from ucm.errors import TransferParamsWarning

log = logging.getLogger(__name__)

BLOCKS = "ucm_blocks"  # the key under which a prefill engine names its blocks


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
