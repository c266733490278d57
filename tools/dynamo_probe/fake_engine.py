"""A fake vLLM engine for tools/dynamo_probe/media_probe.py: an
OpenAI-compatible `/v1/completions` server that streams N tokens (with
`token_ids`, as vLLM does for `return_token_ids`) and records every request
it got, plus a fake vLLM KV event publisher: a ZMQ PUB socket sending
`(topic, 8-byte big-endian seq, msgpack KVEventBatch)` exactly as vLLM's
`ZmqEventPublisher` does (the structs below mirror
`vllm.distributed.kv_events`). Control routes on the same HTTP server:
`POST /fake/publish` with `{"events": [...]}` sends one batch; `GET
/fake/requests` returns the recorded requests. Needs the stdlib, msgspec
and pyzmq only.

    python tools/dynamo_probe/fake_engine.py --http-port 8101 --zmq-port 5557
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Union

import msgspec
import zmq

# ---------------------------------------------------------------------------
# vLLM's KV event wire format (vllm/distributed/kv_events.py, vLLM 0.32)
# ---------------------------------------------------------------------------

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def make_event(d: dict) -> KVCacheEvent:
    d = dict(d)
    kind = d.pop("type")
    if kind == "BlockStored":
        d.setdefault("lora_id", None)
        d.setdefault("lora_name", None)
        d.setdefault("medium", None)
        d.setdefault("parent_block_hash", None)
        return BlockStored(**d)
    if kind == "BlockRemoved":
        d.setdefault("medium", None)
        return BlockRemoved(**d)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


class FakeKvPublisher:
    """vLLM's ZmqEventPublisher without the engine: PUB bound on an endpoint."""

    def __init__(self, endpoint: str, topic: str = ""):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()

    def publish(self, events: list[KVCacheEvent], dp_rank: Optional[int] = None) -> int:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=dp_rank)
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), self.enc.encode(batch)))
        return seq


# ---------------------------------------------------------------------------
# fake OpenAI completions server (+ control routes)
# ---------------------------------------------------------------------------


class FakeEngine:
    def __init__(self, name: str, tokens: int, publisher: Optional[FakeKvPublisher], record: Optional[str]):
        self.name = name
        self.tokens = tokens
        self.publisher = publisher
        self.record = record
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def note(self, body: dict) -> None:
        with self.lock:
            self.requests.append(body)
            if self.record:
                with open(self.record, "a") as f:
                    f.write(json.dumps(body) + "\n")


def make_handler(engine: FakeEngine):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet
            pass

        def _json(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self):
            if self.path == "/fake/requests":
                with engine.lock:
                    return self._json(200, list(engine.requests))
            if self.path in ("/health", "/v1/models"):
                return self._json(200, {"object": "list", "data": [{"id": engine.name}]})
            self._json(404, {"error": self.path})

        def do_POST(self):
            body = self._body()
            if self.path == "/fake/publish":
                if engine.publisher is None:
                    return self._json(400, {"error": "no publisher"})
                seq = engine.publisher.publish([make_event(e) for e in body["events"]], body.get("dp_rank"))
                return self._json(200, {"seq": seq})
            if self.path != "/v1/completions":
                return self._json(404, {"error": self.path})
            engine.note(body)
            prompt = body.get("prompt") or []
            n = min(int(body.get("max_tokens") or engine.tokens), engine.tokens)
            if not body.get("stream"):
                ids = [1000 + i for i in range(n)]
                return self._json(200, {"id": "cmpl-fake", "object": "text_completion", "model": engine.name,
                                        "choices": [{"index": 0, "text": "x" * n, "token_ids": ids,
                                                     "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                  "total_tokens": len(prompt) + n}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def send(obj):
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            for i in range(n):
                choice = {"index": 0, "text": " t%d" % i, "token_ids": [1000 + i],
                          "finish_reason": "length" if i == n - 1 else None}
                if i == 0 and body.get("return_token_ids"):
                    choice["prompt_token_ids"] = prompt
                send({"id": "cmpl-fake", "object": "text_completion", "model": engine.name, "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                send({"id": "cmpl-fake", "object": "text_completion", "model": engine.name, "choices": [],
                      "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                "total_tokens": len(prompt) + n,
                                "prompt_tokens_details": {"cached_tokens": 0}}})
            send(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return H


def serve_engine(args: argparse.Namespace) -> None:
    pub = FakeKvPublisher(f"tcp://127.0.0.1:{args.zmq_port}") if args.zmq_port else None
    engine = FakeEngine(args.name, args.tokens, pub, args.record)
    srv = ThreadingHTTPServer(("127.0.0.1", args.http_port), make_handler(engine))
    print(f"fake engine {args.name} http://127.0.0.1:{args.http_port} zmq={args.zmq_port}", flush=True)
    srv.serve_forever()


def main(argv=None) -> None:
    e = argparse.ArgumentParser(description="one fake vLLM: completions server + KV event PUB")
    e.add_argument("--name", default="fake")
    e.add_argument("--http-port", type=int, required=True)
    e.add_argument("--zmq-port", type=int, default=0)
    e.add_argument("--tokens", type=int, default=8, help="tokens streamed per request (max)")
    e.add_argument("--record", default=None, help="append each request as JSON here")
    serve_engine(e.parse_args(argv))


if __name__ == "__main__":
    main()
