"""ucm's blocks in vLLM's KV event stream.

With vLLM's `kv_events_config` on (`enable_kv_cache_events`), the
scheduler side follows the cache's block catalog with a
`ucm.connectors.kv_events.TierEventReader`, and `UCMConnector.take_events`
hands its changes to vLLM, which publishes them in the same ZMQ stream as
its own GPU blocks: one event source per worker. Each ucm block is one
`BlockStored` over its pages, with the hashes this engine computes for
those tokens (its hash function, its NONE_HASH, the LoRA and cache_salt
extra keys, exactly as `kv_cache_utils.get_request_block_hasher`), the
page size as `block_size`, and the medium of the tier that holds it
(`StorageAdapter.kv_medium`: CPU_TIER1, DISK, EXTERNAL); a move is a
`BlockRemoved` from the old medium and a `BlockStored` with the new one;
a block that left every tier is a `BlockRemoved`.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from ucm.api import CacheAPI, CatalogAPI, Key
from ucm.connectors.kv_events import HashPages, Removed, TierEventReader
from ucm.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

__all__ = ["request_seed", "request_extra", "page_hasher", "to_vllm_events", "EngineEvents", "events_for"]

log = logging.getLogger(__name__)


def request_seed(namespace: Namespace, cache_salt: Optional[str], lora_name: Optional[str]) -> Key:
    """The key seed of a prompt's first block: the engine's namespace,
    salted by the request's cache_salt and LoRA adapter."""
    salt = []
    if cache_salt:
        salt.append(f"salt={cache_salt}")
    if lora_name:
        salt.append(f"lora={lora_name}")
    return (dataclasses.replace(namespace, salt=";".join(salt)) if salt else namespace).digest()


def request_extra(request: "Request") -> Optional[dict]:
    """The request context a block is hashed with besides its tokens
    (`ucm.api.EXTRA_FIELDS`), or None."""
    extra = {}
    if request.cache_salt:
        extra["cache_salt"] = request.cache_salt
    lora = request.lora_request
    if lora is not None:
        extra["lora_name"] = lora.lora_name
        if lora.lora_path:
            extra["lora_path"] = lora.lora_path
    return extra or None


def _lora_keys(extra: Optional[dict]) -> list:
    if not extra or not extra.get("lora_name"):
        return []
    return [("lora", extra["lora_name"], extra.get("lora_path"))]


def page_hasher(vllm_config: "VllmConfig") -> HashPages:
    """This engine's hash of each page of a block (the scheduler's own
    request block hasher, page by page)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    page = vllm_config.cache_config.block_size

    def hash_pages(parent: Optional[Any], tokens: np.ndarray, extra: Optional[dict], first: bool) -> list:
        lora = _lora_keys(extra)
        out = []
        for j in range(0, len(tokens), page):
            keys = list(lora)
            if first and j == 0 and extra and extra.get("cache_salt"):
                keys.append(("cache_salt", extra["cache_salt"]))
            parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[j:j + page].tolist(),
                                                      tuple(keys) if keys else None)
            out.append(parent)
        return out

    return hash_pages


def to_vllm_events(records: list, page_tokens: int) -> list[KVCacheEvent]:
    """The reader's records as vLLM's event types."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

    out: list[KVCacheEvent] = []
    for r in records:
        hashes = [maybe_convert_block_hash(h) for h in r.hashes]
        if isinstance(r, Removed):
            out.append(BlockRemoved(block_hashes=hashes, medium=r.medium))
            continue
        lora = _lora_keys(r.extra)
        per_page = []
        for j in range(len(r.hashes)):
            keys = list(lora)
            if r.parent_hash is None and j == 0 and r.extra and r.extra.get("cache_salt"):
                keys.append(("cache_salt", r.extra["cache_salt"]))
            per_page.append(tuple(keys) if keys else None)
        out.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(r.parent_hash) if r.parent_hash is not None else None,
            token_ids=r.tokens.tolist(), block_size=page_tokens, lora_id=None, medium=r.medium,
            lora_name=r.extra.get("lora_name") if r.extra else None,
            extra_keys=to_event_extra_keys(per_page) if any(per_page) else None))
    return out


class EngineEvents:
    """The KV events of one engine's scheduler side: the blocks it
    describes as it saves them, and the cache's changes as vLLM's events."""

    def __init__(self, reader: TierEventReader, page_tokens: int) -> None:
        self.reader = reader
        self.block_tokens = reader.block_tokens
        self.page_tokens = page_tokens

    def describe(self, keys: list[Key], tokens: Any, extra: Optional[dict], first: int, end: int) -> None:
        """Blocks first..end of a prompt (`keys`, its token ids) whose saves are planned."""
        bt = self.block_tokens
        self.reader.describe([[keys[b], keys[b - 1] if b else None,
                               np.asarray(tokens[b * bt:(b + 1) * bt], dtype="<u4").tobytes(), extra]
                              for b in range(first, end)])

    def take(self) -> list[KVCacheEvent]:
        """The changes since the last call; never raises into vLLM."""
        try:
            return to_vllm_events(self.reader.take(), self.page_tokens)
        except Exception:
            log.warning("UCMConnector: KV events failed; none this step", exc_info=True)
            return []

    def close(self) -> None:
        self.reader.close()
        log.info("UCMConnector: KV events of ucm's tiers at shutdown: %s", self.reader.stats())


def events_for(vllm_config: "VllmConfig", cache: CacheAPI, namespace: Namespace) -> Optional[EngineEvents]:
    """This engine's KV events of `cache`'s blocks, when vLLM publishes KV
    events; None otherwise."""
    kec = getattr(vllm_config, "kv_events_config", None)
    if kec is None or not kec.enable_kv_cache_events:
        return None
    if not isinstance(cache, CatalogAPI):
        log.info("UCMConnector: the cache (%s) keeps no block catalog: vLLM's KV events carry the engine's "
                 "own blocks only", type(cache).__name__)
        return None
    reader = TierEventReader(cache, lambda extra: request_seed(namespace, (extra or {}).get("cache_salt"),
                                                               (extra or {}).get("lora_name")),
                             namespace.block_tokens, page_hasher(vllm_config))
    return EngineEvents(reader, vllm_config.cache_config.block_size)
