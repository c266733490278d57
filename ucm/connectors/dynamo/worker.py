"""Thin NVIDIA Dynamo worker in front of a vLLM OpenAI-compatible server.

`dynamo.vllm` needs a vLLM of its own; this worker only needs Dynamo's
Python runtime (ai-dynamo-runtime + ai-dynamo 1.6.1) and aiohttp, so the
engine keeps running in its own venv (vLLM for CPU + ucm) while Dynamo's KV
router sends it requests. Run it with the Dynamo venv's python; it imports
the stdlib, `dynamo` and aiohttp only (not ucm):

    DYN_FILE_KV=/tmp/dyn-kv .venv-dynamo/bin/python ucm/connectors/dynamo/worker.py \
        --namespace dynamo --model-path ~/.cache/ucm/models/smollm2-135m-instruct \
        --served-model-name smollm2 --page-tokens 128 \
        --engine-url http://127.0.0.1:8001 \
        --kv-events-endpoint tcp://127.0.0.1:5557 \
        --discovery-dir /tmp/dyn-kv --worker-id-file /tmp/w1.id

What it does, as `dynamo.vllm` does for an aggregated worker:

* creates a `DistributedRuntime` with file discovery (`DYN_FILE_KV` = the
  discovery directory, shared with `python -m dynamo.frontend
  --discovery-backend file`), the TCP request plane and the ZMQ event plane
  (Dynamo picks ZMQ for file discovery): no etcd, no NATS;
* registers the model (`register_model(ModelInput.Tokens, Chat|Completions,
  ..., kv_cache_block_size=<page tokens>, worker_type=Aggregated)`), so the
  frontend tokenizes and the router hashes pages of `--page-tokens` tokens;
* relays the engine's KV events: a `KvEventPublisher` subscribes to the
  engine's `kv_events_config` ZMQ PUB socket (vLLM's `ZmqEventPublisher`,
  which ucm's connector also feeds with BlockStored/BlockRemoved for its
  tiers, `medium` naming the tier) and republishes them on Dynamo's event
  plane under this worker's id;
* serves `<namespace>.backend.generate`: each preprocessed request
  (`token_ids`, `sampling_options`, `stop_conditions`, `output_options`) is
  streamed from `POST {engine_url}/v1/completions` with the token ids as the
  prompt and `return_token_ids`, and answered with Dynamo's engine-output
  dicts (`{"index", "token_ids", "finish_reason", "completion_usage"}`),
  as `dynamo.vllm`'s handler yields them.

The worker's id (the instance id the router scores and names in its logs) is
`endpoint.connection_id()`; `--worker-id-file` receives it, and every request
is logged to stderr with its first 8 token ids and this id, so a benchmark can
tell which worker served what.

Environment: on a host with several interfaces set DYN_TCP_RPC_HOST,
DYN_TCP_RESPONSE_STREAM_HOST and DYN_EVENT_PLANE_HOST (e.g. 127.0.0.1 when
everything runs on one machine) so the addresses Dynamo advertises in the
discovery directory are reachable; the frontend needs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any, AsyncIterator

log = logging.getLogger("ucm.dynamo.worker")

# Request fields forwarded to vLLM's /v1/completions. Dynamo's preprocessed
# request keeps sampling knobs in `sampling_options` and limits in
# `stop_conditions` (see dynamo/vllm/handlers.py build_sampling_params).
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Thin Dynamo worker: serves <namespace>.backend.generate from a "
        "vLLM OpenAI-compatible server and relays its KV events to Dynamo's router."
    )
    p.add_argument("--namespace", default="dynamo", help="Dynamo namespace (default: dynamo)")
    p.add_argument("--component", default="backend", help="component name (default: backend)")
    p.add_argument("--endpoint-name", default="generate", help="endpoint name (default: generate)")
    p.add_argument("--model-path", required=True,
                   help="local HF model directory (config.json + tokenizer) the frontend tokenizes with")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model dir's name)")
    p.add_argument("--engine-model-name", default=None,
                   help="model name sent to the engine (default: --served-model-name)")
    p.add_argument("--page-tokens", type=int, required=True,
                   help="tokens per KV page (vLLM --block-size): the router's block size")
    p.add_argument("--engine-url", required=True,
                   help="base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8001")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="the engine's kv_events ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 "
                   "(omit: no KV events, the router then only sees load)")
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic (vLLM default: '')")
    p.add_argument("--discovery-dir", default=None,
                   help="file-discovery directory shared with the frontend (sets DYN_FILE_KV; "
                   "default: $DYN_FILE_KV or Dynamo's $TMPDIR/dynamo_store_kv)")
    p.add_argument("--worker-id-file", default=None,
                   help="write this worker's instance id (decimal) here once registered")
    p.add_argument("--context-length", type=int, default=None, help="max model length to advertise")
    p.add_argument("--total-kv-blocks", type=int, default=None,
                   help="engine KV pages to advertise (the router's load scale)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds one engine request may take (default 3600)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def build_engine_request(request: dict, model: str) -> dict:
    """Map Dynamo's PreprocessedRequest to a vLLM /v1/completions body."""
    sampling = dict(request.get("sampling_options") or {})
    extra = request.get("extra_args") or {}
    if isinstance(extra, dict) and isinstance(extra.get("sampling_options"), dict):
        sampling.update(extra["sampling_options"])
    stop = request.get("stop_conditions") or {}
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.get("token_ids") or []),
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "n": 1,
    }
    for key in _SAMPLING_KEYS:
        if sampling.get(key) is not None:
            body[key] = sampling[key]
    # null (not omitted: vLLM's default is 16) lets vLLM fill the context.
    body["max_tokens"] = stop.get("max_tokens")
    if stop.get("min_tokens") is not None:
        body["min_tokens"] = stop["min_tokens"]
    if stop.get("ignore_eos") is not None:
        body["ignore_eos"] = bool(stop["ignore_eos"])
    # Dynamo handles `stop` strings and visible stop ids while detokenizing;
    # the hidden stop ids (EOS variants) must stop the engine itself.
    stop_ids = list(stop.get("stop_token_ids_hidden") or [])
    if stop_ids:
        body["stop_token_ids"] = stop_ids
    # Logprobs are not relayed (Dynamo's output_options are ignored).
    return body


def _normalize_finish(reason: str | None) -> str | None:
    if reason and reason.startswith("abort"):
        return "cancelled"
    return reason


class EngineClient:
    """Streams completions from the vLLM OpenAI server as Dynamo outputs."""

    def __init__(self, base_url: str, model: str, timeout: float):
        import aiohttp

        self._aiohttp = aiohttp
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=30)
        self.session: Any = None

    async def start(self) -> None:
        self.session = self._aiohttp.ClientSession(timeout=self.timeout)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def stream(self, request: dict) -> AsyncIterator[dict]:
        body = build_engine_request(request, self.model)
        prompt_len = len(body["prompt"])
        completion = 0
        finish: dict | None = None
        usage: dict | None = None
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:500]
                yield {"index": 0, "token_ids": [],
                       "finish_reason": f"error: engine HTTP {resp.status}: {text}"}
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if msg.get("usage"):
                        usage = msg["usage"]
                    for choice in msg.get("choices") or []:
                        ids = list(choice.get("token_ids") or [])
                        reason = _normalize_finish(choice.get("finish_reason"))
                        completion += len(ids)
                        if reason is not None:
                            # Hold the last chunk until the usage chunk that
                            # follows it, so completion_usage carries the
                            # engine's cached-token count.
                            finish = {"index": 0, "token_ids": ids, "finish_reason": reason}
                        elif ids:
                            yield {"index": 0, "token_ids": ids}
        if finish is None:
            finish = {"index": 0, "token_ids": [], "finish_reason": "error: engine stream ended without a finish_reason"}
        finish["completion_usage"] = _usage(usage, prompt_len, completion)
        yield finish


def _usage(usage: dict | None, prompt_len: int, completion: int) -> dict:
    out = {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }
    if usage:
        out["prompt_tokens"] = usage.get("prompt_tokens", prompt_len)
        out["completion_tokens"] = usage.get("completion_tokens", completion)
        out["total_tokens"] = usage.get("total_tokens", out["prompt_tokens"] + out["completion_tokens"])
        details = usage.get("prompt_tokens_details")
        if details and details.get("cached_tokens") is not None:
            out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


class Handler:
    def __init__(self, engine: EngineClient, worker_id: int):
        self.engine = engine
        self.worker_id = worker_id

    async def generate(self, request: dict, context: Any = None) -> AsyncIterator[dict]:
        if isinstance(request, str):
            request = json.loads(request)
        token_ids = request.get("token_ids") or []
        rid = context.id() if context is not None else "-"
        t0 = time.monotonic()
        print(
            f"[ucm-dynamo-worker] request {rid} worker_id={self.worker_id} "
            f"prompt_tokens={len(token_ids)} first8={list(token_ids[:8])}",
            file=sys.stderr, flush=True,
        )
        produced = 0
        try:
            async for out in self.engine.stream(request):
                produced += len(out.get("token_ids") or [])
                yield out
                if "finish_reason" not in out and context is not None and context.is_stopped():
                    # Leaving the `async with` closes the HTTP stream, which
                    # aborts the request in vLLM.
                    yield {"index": 0, "token_ids": [], "finish_reason": "cancelled"}
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine unreachable, bad JSON...
            log.exception("request %s failed", rid)
            yield {"index": 0, "token_ids": [], "finish_reason": f"error: {e}"}
        finally:
            print(
                f"[ucm-dynamo-worker] done {rid} worker_id={self.worker_id} "
                f"tokens={produced} secs={time.monotonic() - t0:.3f}",
                file=sys.stderr, flush=True,
            )


async def run(args: argparse.Namespace) -> None:
    # Dynamo reads its configuration from the environment when the runtime is
    # created: the file-discovery root and the planes.
    if args.discovery_dir:
        os.makedirs(args.discovery_dir, exist_ok=True)
        os.environ["DYN_FILE_KV"] = args.discovery_dir
    os.environ.setdefault("DYN_DISCOVERY_BACKEND", "file")
    os.environ.setdefault("DYN_REQUEST_PLANE", "tcp")

    from dynamo.llm import (
        KvEventPublisher,
        ModelInput,
        ModelRuntimeConfig,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop,
        os.environ["DYN_DISCOVERY_BACKEND"],
        os.environ["DYN_REQUEST_PLANE"],
        event_plane=os.environ.get("DYN_EVENT_PLANE") or None,
        response_plane=os.environ.get("DYN_RESPONSE_PLANE") or "tcp",
    )
    path = f"{args.namespace}.{args.component}.{args.endpoint_name}"
    endpoint = runtime.endpoint(path)
    worker_id = int(endpoint.connection_id())
    served = args.served_model_name or os.path.basename(os.path.normpath(args.model_path))
    log.info("worker %d serving %s for model %s", worker_id, path, served)

    publisher = None
    if args.kv_events_endpoint:
        publisher = KvEventPublisher(
            endpoint=endpoint,
            kv_block_size=args.page_tokens,
            zmq_endpoint=args.kv_events_endpoint,
            zmq_topic=args.kv_events_topic,
        )
        log.info("relaying KV events from %s", args.kv_events_endpoint)

    rc = ModelRuntimeConfig()
    if args.context_length:
        rc.context_length = args.context_length
    if args.total_kv_blocks:
        rc.total_kv_blocks = args.total_kv_blocks
    if args.max_num_seqs:
        rc.max_num_seqs = args.max_num_seqs
    if args.max_num_batched_tokens:
        rc.max_num_batched_tokens = args.max_num_batched_tokens
    rc.kv_event_publishing_enabled = publisher is not None

    engine = EngineClient(args.engine_url, args.engine_model_name or served, args.request_timeout)
    await engine.start()
    handler = Handler(engine, worker_id)

    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        endpoint,
        args.model_path,
        served,
        kv_cache_block_size=args.page_tokens,
        runtime_config=rc,
        worker_type=WorkerType.Aggregated,
    )
    if args.worker_id_file:
        tmp = args.worker_id_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{worker_id}\n")
        os.replace(tmp, args.worker_id_file)

    def _stop() -> None:
        log.info("shutting down worker %d", worker_id)
        runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop)

    try:
        await endpoint.serve_endpoint(handler.generate, graceful_shutdown=True)
    finally:
        if publisher is not None:
            publisher.shutdown()
        await engine.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop  # installed with ai-dynamo

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
