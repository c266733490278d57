"""A blended request as the scheduler side sees it: the chunk spans in its
`kv_transfer_params`, whether this engine may blend it, and the keys of
its chunks' entries.

A request declares its chunks (retrieved passages) as

    kv_transfer_params: {"ucm_chunks": [[start, end], ...]}

token spans of its prompt, in order, not overlapping (or, on an engine
with `ucm_blend_separator`, as LMCache does: the parts of its prompt
between occurrences of the separator's tokens), and may set its own
`blend` accelerator options, e.g. `"ucm_blend": {"ratio": 0.3}` or
`{"select": "question"}` (the engine's otherwise; on vLLM `context` is
`prefix`). The prompt's tokens before the first chunk are its system
prompt, computed exactly; the blended part ends where the last chunk does
(at most the prompt's length - 1); the rest (the question) is vLLM's to
compute. A chunk's entry is the KV of its whole blocks computed after the
system prompt, keyed in a namespace of their own (`chunk_namespace`): the
engine's, with a layout naming the system prompt (its length, which is the
position the chunk was computed at, and a digest of its tokens) and the
model's RoPE settings, so another system prompt or RoPE is never a hit.
The worker (ucm/connectors/vllm/blend.py) loads, rotates and recomputes.

Spans that are malformed are a TransferParamsWarning and the request is
served as a plain one. A request is not blended (served as a plain one,
logged) when the engine cannot: no model handle (vLLM not started with
`worker_cls` UcmCPUWorker, ucm/connectors/vllm/blend_worker.py), or vLLM's
own prefix cache on and the request without a `cache_salt` (vLLM would
then serve the blended pages to later requests as an exact prefix).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np

from ucm.api import Key
from ucm.connectors.vllm.metadata import BlendJob
from ucm.errors import ConfigError, TransferParamsWarning
from ucm.keys import Namespace, block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ucm.accelerators.blend import BlendOptions
    from ucm.config.schema import UcmConfig
    from vllm.v1.request import Request

    from ucm.connectors.vllm.request_state import ReqState

log = logging.getLogger(__name__)

CHUNKS = "ucm_chunks"
OPTIONS = "ucm_blend"
WORKER_CLS = "ucm.connectors.vllm.blend_worker.UcmCPUWorker"


def chunk_spans(params: Any, num_tokens: int, request_id: str) -> list[tuple[int, int]]:
    """The chunk spans a request declares ([] for none); spans that are not
    a list of [start, end] ints with 0 <= start < end <= num_tokens, in
    order and not overlapping, are a TransferParamsWarning and [] (the
    request is served as a plain one)."""
    if not isinstance(params, Mapping) or params.get(CHUNKS) is None:
        return []
    raw = params[CHUNKS]
    spans: list[tuple[int, int]] = []
    problem = ""
    if not isinstance(raw, (list, tuple)) or not raw:
        problem = "is not a non-empty list of [start, end] spans"
    else:
        end = 0
        for item in raw:
            ok = (isinstance(item, (list, tuple)) and len(item) == 2
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in item))
            if not ok or not end <= item[0] < item[1] <= num_tokens:
                problem = (f"span {item!r} is not [start, end] with {end} <= start < end <= {num_tokens} "
                           "(spans in order, not overlapping, within the prompt)")
                break
            spans.append((item[0], item[1]))
            end = item[1]
    if problem:
        msg = f"request {request_id}: kv_transfer_params.{CHUNKS} {problem}; it is served as a plain request"
        log.warning("UCMConnector: %s", msg)
        warnings.warn(msg, TransferParamsWarning, stacklevel=2)
        return []
    return spans


def request_options(params: Any, request_id: str) -> dict[str, Any]:
    """The request's own `blend` options (`ucm_blend`, a mapping of
    BlendOptions fields; {}: the engine's). A mapping that BlendOptions
    refuses or a `context` other than `prefix` is a TransferParamsWarning
    and {}."""
    from ucm.accelerators.blend import BlendOptions

    if not isinstance(params, Mapping) or params.get(OPTIONS) is None:
        return {}
    raw = params[OPTIONS]
    problem = ""
    if not isinstance(raw, Mapping):
        problem = f"must be a mapping of blend options, got {type(raw).__name__}"
    elif raw.get("context", "prefix") != "prefix":
        problem = f"context {raw['context']!r}: vLLM blends passages computed after the system prompt ('prefix')"
    else:
        try:
            BlendOptions(**raw)
        except Exception as exc:  # pydantic's ValidationError names the field and the allowed values
            problem = str(exc).replace("\n", "; ")
    if not problem:
        return dict(raw)
    msg = f"request {request_id}: kv_transfer_params.{OPTIONS} {problem}; the engine's blend options are used"
    log.warning("UCMConnector: %s", msg)
    warnings.warn(msg, TransferParamsWarning, stacklevel=2)
    return {}


def engine_options(config: "UcmConfig") -> "BlendOptions":
    """The `blend` accelerator's options in the engine's config (the
    defaults without the entry); a `context` other than `prefix` is a
    ConfigError naming the key: vLLM blends passages computed after the
    system prompt only."""
    from ucm.accelerators.blend import BlendOptions

    for i, entry in enumerate(config.accelerators):
        if entry.name == "blend":
            options = BlendOptions(**entry.options)
            if options.context != "prefix":
                raise ConfigError(f"accelerators.{i}.options.context: {options.context!r} is not supported by "
                                  "the vLLM connector; allowed: ['prefix']")
            return options
    return BlendOptions()


def separated_spans(tokens: Sequence[int], separator: Sequence[int]) -> list[tuple[int, int]]:
    """The parts of `tokens` between consecutive occurrences of
    `separator` (the passages of `system SEP p1 SEP p2 SEP question`);
    [] with fewer than two occurrences. Empty parts are not passages."""
    sep, n = list(separator), len(separator)
    if not n:
        return []
    first = sep[0]
    found, i = [], 0
    while i + n <= len(tokens):
        if tokens[i] == first and list(tokens[i:i + n]) == sep:
            found.append(i)
            i += n
        else:
            i += 1
    return [(a + n, b) for a, b in zip(found, found[1:]) if b > a + n]


def blend_end(spans: Sequence[tuple[int, int]], num_tokens: int) -> int:
    """Where the blended part ends: the last chunk's end, leaving vLLM at
    least the prompt's last token."""
    return min(spans[-1][1], num_tokens - 1) if spans else 0


def why_not_blend(vllm_config: "VllmConfig") -> str:
    """Why this engine cannot blend at all ('' when it can)."""
    worker_cls = getattr(vllm_config.parallel_config, "worker_cls", "")
    if worker_cls != WORKER_CLS:
        return f"vLLM's worker_cls is {worker_cls!r}; blending needs {WORKER_CLS!r} (the model's handle)"
    return ""


def rope_settings(vllm_config: "VllmConfig") -> str:
    """A digest of what fixes the model's RoPE (base, scaling, head size)
    in its config: part of the chunks' namespace even when `ucm_model_id`
    names the model."""
    hf = vllm_config.model_config.hf_config.to_dict()
    picked = {k: hf.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters", "head_dim",
                                     "partial_rotary_factor", "max_position_embeddings")}
    return hashlib.blake2b(json.dumps(picked, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def chunk_namespace(base: Namespace, prefix: Sequence[int], rope: str, salt: Optional[str]) -> Namespace:
    """The namespace of chunk entries computed after `prefix` (the system
    prompt) by this engine (`base`), with RoPE settings `rope` and the
    request's `cache_salt`."""
    digest = hashlib.blake2b(np.asarray(list(prefix), dtype=np.int64).tobytes(), digest_size=8).hexdigest()
    layout = f"chunk-after-{len(prefix)}-{digest}-rope-{rope}-{base.layout}"
    return dataclasses.replace(base, layout=layout, salt=f"{base.salt}|{salt}" if salt else base.salt)


def chunk_keys(ns: Namespace, tokens: Sequence[int], spans: Sequence[tuple[int, int]], end: int) -> list[list[Key]]:
    """Per chunk, the keys of its whole blocks within the blended part."""
    return [block_keys(ns, list(tokens[s:min(e, end)])) for s, e in spans]


class BlendPlanner:
    """The scheduler side's part of blending: per request, the declared
    chunks (`begin`), the claim of the blended part (`claim`) and the job
    for the worker (`job`); `counts` says how many were blended or declined."""

    def __init__(self, namespace: Namespace, *, why_not: str = "", prefix_caching: bool = False,
                 rope: str = "", separator: Sequence[int] = ()) -> None:
        self.namespace, self.why_not, self.prefix_caching, self.rope = namespace, why_not, prefix_caching, rope
        self.separator = list(separator)  # the tokens of `ucm_blend_separator` ([]: spans only)
        self.counts: Counter = Counter()

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig", namespace: Namespace,
                  separator: Optional[str] = None) -> "BlendPlanner":
        """The engine's planner; `separator` (`ucm_blend_separator`) is
        tokenized with the model's tokenizer, without special tokens."""
        tokens: list[int] = []
        if separator:
            from transformers import AutoTokenizer

            mc = vllm_config.model_config
            try:
                tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                                    trust_remote_code=mc.trust_remote_code)
                tokens = tok(separator, add_special_tokens=False).input_ids
            except Exception as exc:
                raise ConfigError(f"kv_connector_extra_config.ucm_blend_separator: the model's tokenizer "
                                  f"({mc.tokenizer}) could not tokenize it: {type(exc).__name__}: {exc}") from exc
            if not tokens:
                raise ConfigError(f"kv_connector_extra_config.ucm_blend_separator: {separator!r} has no tokens")
        return cls(namespace, why_not=why_not_blend(vllm_config),
                   prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                   rope=rope_settings(vllm_config), separator=tokens)

    def begin(self, st: "ReqState", request: "Request") -> None:
        """Reads the request's chunk spans (a malformed one: a warning and none)."""
        params = getattr(request, "kv_transfer_params", None)
        st.chunks = chunk_spans(params, len(request.prompt_token_ids), request.request_id)
        if not st.chunks and self.separator and not (isinstance(params, Mapping) and params.get(CHUNKS)):
            st.chunks = separated_spans(request.prompt_token_ids, self.separator)
        st.blend_options = request_options(params, request.request_id) if st.chunks else {}

    def claim(self, st: "ReqState", request: "Request", num_computed_tokens: int) -> int:
        """The blended part beyond vLLM's own hit, as tokens of a synchronous
        load (0, and the request served as a plain one, where it cannot be
        blended: logged with the reason)."""
        end, s0 = blend_end(st.chunks, request.num_tokens), st.chunks[0][0]
        why = self.why_not
        if not why and self.prefix_caching and not request.cache_salt:
            why = "vLLM's prefix cache is on and the request has no cache_salt"
        if not why and num_computed_tokens > s0:
            why = f"vLLM's own prefix cache holds {num_computed_tokens} tokens, past the system prompt ({s0})"
        if not why and end <= num_computed_tokens:
            why = "nothing after vLLM's own hit to blend"
        if why:
            log.info("UCMConnector: request %s is not blended (%s); it is served as a plain request",
                     request.request_id, why)
            self.counts["declined"] += 1
            st.chunks = []
            return 0
        st.blending, st.local_tokens = True, num_computed_tokens
        st.external_tokens = end - num_computed_tokens
        st.load_async, st.load_stream = False, False
        return st.external_tokens

    def job(self, st: "ReqState", request: "Request") -> BlendJob:
        """What the worker blends, once vLLM gave the request its pages."""
        end = blend_end(st.chunks, request.num_tokens)
        tokens = list(request.prompt_token_ids[:end])
        ns = chunk_namespace(self.namespace, tokens[:st.chunks[0][0]], self.rope, request.cache_salt)
        self.counts["blended"] += 1
        return BlendJob(req_id=request.request_id, tokens=tokens, spans=list(st.chunks),
                        keys=chunk_keys(ns, tokens, st.chunks, len(tokens)), block_tokens=self.namespace.block_tokens,
                        page_ids=list(st.page_ids), start=st.local_tokens, options=st.blend_options,
                        question=list(request.prompt_token_ids[end:]))

    def failed(self, st: "ReqState") -> None:
        """The worker could not blend it: vLLM recomputes it as a plain request."""
        if st.blending:
            self.counts["failed"] += 1
        st.blending, st.chunks = False, []
