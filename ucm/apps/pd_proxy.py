"""`ucm pd-proxy`: prefill/decode disaggregation in front of vLLM engines that
run ucm's connector, in vLLM's own disaggregated-serving pattern (its
examples' proxy for the NIXL and Mooncake connectors).

An OpenAI request (`/v1/completions`, `/v1/chat/completions`, streamed or
not) goes first to a prefill engine, as a copy with `max_tokens` 1, not
streamed, and `kv_transfer_params: {"do_remote_decode": true}`: its
connector (kv_producer or kv_both) saves the prompt's blocks and returns
their keys in the response's `kv_transfer_params` (ucm/connectors/vllm/pd.py).
Then the original request goes to a decode engine with those params, and
its answer, streamed as it comes, is the client's. The decode engine's
connector (kv_consumer or kv_both) loads the blocks once committed and
computes only the prompt's last partial block.

Engines are picked by load: the one with the fewest requests in flight
from this proxy, ties by the fewest served. Given the engines' KV event
endpoints (`--prefill-events`, `--decode-events`: vLLM's
`--kv-events-config` ZMQ publishers, in the engines' order), the proxy
also knows which prompt blocks each engine holds, on its GPU or, through
ucm's connector, in ucm's tiers (ucm/apps/kv_index.py), and picks by where
the KV is: a prefill engine by the fewest blocks to compute, the prompt's
blocks it does not hold plus those it is computing for requests in flight
(Dynamo's KV router's cost), ties by the longer run on its GPU; a decode
engine by the fewest requests in flight, ties by the longer run held.
Prompts are matched as token ids (ucm/apps/prompt_tokens.py: text and
chat through `--tokenizer`, the model's directory); one it cannot tell is
picked by load. A prefill step that fails
(engine down, an error status, no params) is logged and counted, and the
decode engine serves the request as a plain one.

With `--prefill-order shortest` the prefill copy also carries vLLM's
`priority`: the prompt's length in tokens (behind the client's own
`priority`, times 2**24), so that prefill engines run with
`--scheduling-policy priority` take the shortest waiting prompt first. A
prefill engine is one queue of jobs of known size, where shortest-first
gives the least mean wait; a long prompt runs as soon as no shorter one
waits. The length is the prompt's token count where the proxy can tell it
(token ids, or text with `--tokenizer`), else the characters of its
strings (prompt or messages) over 4. An engine that refuses the field
(HTTP 400 naming priority) gets the request again without it, and no
priority from then on. The decode step is sent as the client sent it.

The proxy itself holds no KV and talks HTTP only; the blocks travel
through ucm (on one node the service's shared arena). `GET /v1/models` is
the first decode engine's; `GET /health` is 200 while some prefill and
some decode engine answer; `GET /pd/stats` gives the counters (and the
index's) as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ucm.apps.kv_index import EventFeed, PrefixIndex, endpoint
from ucm.apps.prompt_tokens import PromptTokens
from ucm.errors import ConfigError

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
ORDERS = ("arrival", "shortest")  # --prefill-order
PRIORITY_SCALE = 1 << 24  # the client's priority ranks before the prompt's length (longer than any context)
# Response headers of an engine that the proxy's own response must not copy.
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


@dataclass
class Engine:
    """One engine behind the proxy, with what the proxy knows of its load."""

    url: str
    inflight: int = 0
    served: int = 0
    failures: int = 0
    pending_blocks: int = 0  # prompt blocks it computes for requests in flight (known with KV events)
    no_priority: bool = False  # it refused vLLM's `priority` field (not run with --scheduling-policy priority)


@dataclass
class Pick:
    """An engine picked for a request, and the prompt blocks it holds
    (GPU run, run held anywhere) and must compute, where the index knew."""

    engine: Engine
    gpu_blocks: int = 0
    held_blocks: int = 0
    new_blocks: int = 0


class EnginePool:
    """Engines of one role; `pick` takes the least loaded, or with an
    index, the cheapest for the prompt (see the module docstring)."""

    def __init__(self, role: str, urls: Sequence[str], events: Optional[Sequence[str]] = None) -> None:
        if not urls:
            raise ConfigError(f"pd-proxy: --{role} needs at least one engine URL")
        bad = [u for u in urls if not (u.startswith("http://") or u.startswith("https://"))]
        if bad:
            raise ConfigError(f"pd-proxy: --{role} URLs must start with http:// or https://, got {bad}")
        if events is not None and len(events) != len(urls):
            raise ConfigError(f"pd-proxy: --{role}-events needs one endpoint per --{role} engine, in their order: "
                              f"{len(urls)} engines, {len(events)} endpoints")
        self.role = role
        self.engines = [Engine(u.rstrip("/")) for u in urls]
        self.events = dict(zip((e.url for e in self.engines), events)) if events else {}
        for url, where in self.events.items():
            endpoint(where, url)  # a bad one is a ConfigError now, not when the app starts
        self.index: Optional[PrefixIndex] = PrefixIndex(self.events) if events else None
        self.feed: Optional[EventFeed] = None

    def follow(self) -> None:
        """Starts following the engines' KV events (when configured)."""
        if self.index is not None and self.feed is None:
            self.feed = EventFeed(self.index, self.events)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def pick(self, tokens: Optional[list[int]] = None) -> Pick:
        size = self.index.block_size() if self.index is not None else None
        if not size or tokens is None:
            return Pick(min(self.engines, key=lambda e: (e.inflight, e.served)))
        blocks = len(tokens) // size
        held = self.index.match(tokens)
        picks = [Pick(e, *held[e.url], blocks - held[e.url][1]) for e in self.engines]
        if self.role == "prefill":
            return min(picks, key=lambda p: (p.new_blocks + p.engine.pending_blocks, -p.gpu_blocks,
                                             p.engine.inflight, p.engine.served))
        return min(picks, key=lambda p: (p.engine.inflight, -p.held_blocks, -p.gpu_blocks, p.engine.served))


class PdProxy:
    """The proxy's state and handlers; `app()` builds the aiohttp app."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, timeout_s: float = 600.0,
                 prefill_events: Optional[Sequence[str]] = None, decode_events: Optional[Sequence[str]] = None,
                 tokenizer: Optional[str] = None, prefill_order: str = "arrival") -> None:
        if not timeout_s > 0:
            raise ConfigError(f"pd-proxy: --timeout-s must be > 0, got {timeout_s!r}")
        if prefill_order not in ORDERS:
            raise ConfigError(f"pd-proxy: --prefill-order must be one of {list(ORDERS)}, got {prefill_order!r}")
        self.prefill_order = prefill_order
        self.prefill = EnginePool("prefill", prefill, prefill_events)
        self.decode = EnginePool("decode", decode, decode_events)
        self.prompts = PromptTokens(tokenizer)
        self.timeout_s = timeout_s
        self.counters = {"requests": 0, "prefill_failures": 0, "decode_failures": 0, "prefill_s": 0.0,
                         "prompts_matched": 0, "prefill_blocks_held": 0, "prefill_blocks_new": 0,
                         "priority_refused": 0}
        self._session: Any = None

    # ---- the app --------------------------------------------------------------
    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in ROUTES:
            app.router.add_post(path, self._relay)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/pd/stats", self._stats)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: Any) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(limit=0))
        self.prefill.follow()
        self.decode.follow()

    async def _close(self, app: Any) -> None:
        self.prefill.close()
        self.decode.close()
        if self._session is not None:
            await self._session.close()

    # ---- the two steps ----------------------------------------------------------
    async def _prefill_step(self, path: str, body: dict, request_id: str,
                            tokens: Optional[list[int]]) -> Optional[dict]:
        """The prefill engine's `kv_transfer_params` for the request, or None
        when the step failed (the decode engine then computes the prompt)."""
        pick = self.prefill.pick(tokens)
        engine = pick.engine
        self.counters["prefill_blocks_held"] += pick.held_blocks
        self.counters["prefill_blocks_new"] += pick.new_blocks
        req = copy.deepcopy(body)
        params = dict(req.get("kv_transfer_params") or {})
        params.update(do_remote_decode=True, do_remote_prefill=False)
        req["kv_transfer_params"] = params
        req["stream"] = False
        req["max_tokens"] = 1
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        for k in ("stream_options", "min_tokens"):
            req.pop(k, None)
        ordered = self.prefill_order == "shortest" and not engine.no_priority
        if ordered:
            req["priority"] = _priority(body, tokens)
        engine.inflight += 1
        engine.pending_blocks += pick.new_blocks
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            status, text = await self._post(engine.url + path, req, request_id)
            if ordered and status == 400 and "priority" in text.lower():
                engine.no_priority = True
                self.counters["priority_refused"] += 1
                log.warning("pd-proxy: prefill engine %s refuses `priority` (run it with --scheduling-policy "
                            "priority for --prefill-order shortest); it gets requests in arrival order", engine.url)
                if "priority" in body:
                    req["priority"] = body["priority"]
                else:
                    del req["priority"]
                status, text = await self._post(engine.url + path, req, request_id)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {text[:300]}")
            got = json.loads(text).get("kv_transfer_params")
            if not isinstance(got, dict) or not got.get("do_remote_prefill"):
                raise RuntimeError(f"no kv_transfer_params in its answer (is it running ucm's connector as "
                                   f"kv_producer or kv_both?): {text[:200]}")
            engine.served += 1
            return got
        except Exception as exc:
            engine.failures += 1
            self.counters["prefill_failures"] += 1
            log.warning("pd-proxy: prefill at %s failed for %s (%s); the decode engine computes the prompt",
                        engine.url, request_id, exc)
            return None
        finally:
            engine.inflight -= 1
            engine.pending_blocks -= pick.new_blocks
            self.counters["prefill_s"] += loop.time() - started

    async def _post(self, url: str, body: dict, request_id: str) -> tuple[int, str]:
        async with self._session.post(url, json=body, headers={"X-Request-Id": request_id}) as resp:
            return resp.status, await resp.text()

    async def _relay(self, request: Any) -> Any:
        from aiohttp import web

        path = request.path
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the body must be a JSON object", "type":
                                                "invalid_request_error"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body must be a JSON object", "type":
                                                "invalid_request_error"}}, status=400)
        self.counters["requests"] += 1
        request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        tokens = None
        if self.prefill.index is not None or self.decode.index is not None or self.prefill_order == "shortest":
            tokens = await asyncio.get_running_loop().run_in_executor(None, self.prompts.tokens, path, body)
            self.counters["prompts_matched"] += tokens is not None
        params = await self._prefill_step(path, body, request_id, tokens)
        req = dict(body)
        if params is not None:
            req["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), **params}
        engine = self.decode.pick(tokens).engine
        engine.inflight += 1
        out = None
        try:
            async with self._session.post(engine.url + path, json=req,
                                          headers={"X-Request-Id": request_id}) as resp:
                headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
                if not body.get("stream"):
                    return web.Response(body=await resp.read(), status=resp.status, headers=headers)
                out = web.StreamResponse(status=resp.status, headers=headers)
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                engine.served += 1
                return out
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away
        except Exception as exc:
            engine.failures += 1
            self.counters["decode_failures"] += 1
            log.warning("pd-proxy: decode at %s failed for %s: %s", engine.url, request_id, exc)
            if out is not None and out.prepared:  # part of the answer went out: end it there
                return out
            return web.json_response({"error": {"message": f"decode engine {engine.url} failed: {exc}",
                                                "type": "upstream_error"}}, status=502)
        finally:
            engine.inflight -= 1

    # ---- the rest -----------------------------------------------------------------
    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        try:
            async with self._session.get(self.decode.engines[0].url + "/v1/models") as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
        except Exception as exc:
            return web.json_response({"error": {"message": str(exc), "type": "upstream_error"}}, status=502)

    async def _up(self, engine: Engine) -> bool:
        try:
            async with self._session.get(engine.url + "/health") as resp:
                return resp.status == 200
        except Exception:
            return False

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        ups = {role: await asyncio.gather(*(self._up(e) for e in pool.engines))
               for role, pool in (("prefill", self.prefill), ("decode", self.decode))}
        ok = any(ups["prefill"]) and any(ups["decode"])
        return web.json_response({role: dict(zip((e.url for e in pool.engines), ups[role]))
                                  for role, pool in (("prefill", self.prefill), ("decode", self.decode))},
                                 status=200 if ok else 503)

    async def _stats(self, request: Any) -> Any:
        from aiohttp import web

        def engine(pool: EnginePool, e: Engine) -> dict:
            row = {"url": e.url, "inflight": e.inflight, "served": e.served, "failures": e.failures}
            if pool.index is not None:
                row.update(pending_blocks=e.pending_blocks, indexed_blocks=pool.index.blocks(e.url))
            return row

        return web.json_response({**self.counters, **{pool.role: [engine(pool, e) for e in pool.engines]
                                                      for pool in (self.prefill, self.decode)},
                                  "index": {pool.role: dict(pool.index.counts) for pool in (self.prefill, self.decode)
                                            if pool.index is not None}})


def _priority(body: dict, tokens: Optional[list[int]]) -> int:
    """vLLM's `priority` for a prefill copy under `--prefill-order shortest`
    (lower runs first): the client's, then the prompt's length."""
    own = body.get("priority", 0)
    own = own if isinstance(own, int) and not isinstance(own, bool) else 0
    if tokens is not None:
        length = len(tokens)
    else:
        length = _chars(body.get("messages") if "messages" in body else body.get("prompt")) // 4
    return own * PRIORITY_SCALE + min(length, PRIORITY_SCALE - 1)


def _chars(x: Any) -> int:
    """The characters of every string in a prompt or a chat's messages
    (walked without recursion: a client's nesting has no bound)."""
    n, todo = 0, [x]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return n


def register(sub: Any) -> None:
    p = sub.add_parser("pd-proxy", help="prefill/decode disaggregation: run each request on a prefill engine, "
                                        "then on a decode engine that loads its KV through ucm",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill engines (vLLM with ucm's connector, kv_producer or kv_both)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode engines (vLLM with ucm's connector, kv_consumer or kv_both)")
    p.add_argument("--prefill-events", nargs="+", metavar="ENDPOINT", default=None,
                   help="the prefill engines' KV event publishers (their --kv-events-config endpoint, e.g. "
                        "tcp://127.0.0.1:5557), one per --prefill engine in order: pick by where the KV is")
    p.add_argument("--decode-events", nargs="+", metavar="ENDPOINT", default=None,
                   help="the decode engines' KV event publishers, one per --decode engine in order")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the model's directory (tokenizer.json, tokenizer_config.json): text and chat prompts "
                        "matched against the KV events (token-id prompts need none)")
    p.add_argument("--prefill-order", choices=ORDERS, default="arrival",
                   help="the order prefill engines take waiting prompts in: arrival (vLLM's default) or shortest "
                        "(the prompt's length as vLLM's `priority`; run the prefill engines with "
                        "--scheduling-policy priority)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request and step (default 600)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from aiohttp import web

    proxy = PdProxy(args.prefill, args.decode, timeout_s=args.timeout_s, prefill_events=args.prefill_events,
                    decode_events=args.decode_events, tokenizer=args.tokenizer, prefill_order=args.prefill_order)
    logging.getLogger().setLevel(logging.INFO)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=lambda msg: log.info("%s", msg))
    return 0
