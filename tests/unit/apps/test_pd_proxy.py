"""`ucm pd-proxy` (ucm/apps/pd_proxy.py) against fake engines on 127.0.0.1:
the prefill step gets a one-token, unstreamed copy asking for
`do_remote_decode`; the decode step gets the original request with the
prefill engine's `kv_transfer_params`, and its answer (streamed or not)
reaches the client unchanged; a failed prefill step leaves a plain decode
request; engines are picked by load; bad input is a typed error."""
import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from ucm.apps.pd_proxy import EnginePool, PdProxy  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "ucm_blocks": ["ab" * 16], "remote_num_tokens": 256}


class FakeEngine:
    """An OpenAI server that records what it got. `role` "prefill" answers
    with PARAMS (or `status`); "decode" answers, streamed or not, with
    the kv_transfer_params it got. `hold`: an Event each request waits for."""

    def __init__(self, role, status=200, hold=None, refuse_priority=False):
        self.role, self.status, self.hold, self.got = role, status, hold, []
        self.refuse_priority = refuse_priority  # as an engine without --scheduling-policy priority may
        self.url, self._runner = None, None

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self):
        await self._runner.cleanup()

    async def _health(self, request):
        return web.Response(text="ok")

    async def _models(self, request):
        return web.json_response({"data": [{"id": "m"}]})

    async def _handle(self, request):
        body = await request.json()
        self.got.append((request.path, body, request.headers.get("X-Request-Id")))
        if self.hold is not None:
            await self.hold.wait()
        if self.status != 200:
            return web.Response(status=self.status, text="engine error")
        if self.refuse_priority and body.get("priority"):
            return web.json_response({"error": {"message": "Got priority 3 but Priority scheduling is not "
                                                           "enabled."}}, status=400)
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        params = body.get("kv_transfer_params")
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "answer"}], "got_params": params})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for word in ("one", "two", "three"):
            await out.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def _with_proxy(prefill, decode, fn, **options):
    engines = [await e.start() for e in (*prefill, *decode)]
    if callable(options.get("prefill_events")):
        options["prefill_events"] = options["prefill_events"](len(prefill))
    proxy = PdProxy([e.url for e in prefill], [e.url for e in decode], **options)
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            return await fn(session, url, proxy)
    finally:
        await runner.cleanup()
        for e in engines:
            await e.stop()


def test_the_prefill_step_is_one_unstreamed_token_and_the_decode_step_gets_its_params():
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "stream": False, "min_tokens": 4,
            "kv_transfer_params": {"ucm_pd_wait_s": 2.0}}

    async def run(session, url, proxy):
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            return await r.json()

    got = asyncio.run(_with_proxy([p], [d], run))
    [(path, pre, pid)] = p.got
    assert path == "/v1/completions"
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "min_tokens" not in pre
    assert pre["kv_transfer_params"] == {"ucm_pd_wait_s": 2.0, "do_remote_decode": True, "do_remote_prefill": False}
    [(_, dec, did)] = d.got
    assert dec["max_tokens"] == 64 and dec["min_tokens"] == 4 and dec["prompt"] == [1, 2, 3]
    assert dec["kv_transfer_params"] == {"ucm_pd_wait_s": 2.0, **PARAMS}
    assert pid == did and pid.startswith("pd-")  # one request id for both steps
    assert got == {"choices": [{"text": "answer"}], "got_params": {"ucm_pd_wait_s": 2.0, **PARAMS}}


def test_a_streamed_chat_answer_reaches_the_client_as_the_decode_engine_sent_it():
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 32,
            "stream": True, "stream_options": {"include_usage": True}}

    async def run(session, url, proxy):
        async with session.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "mine"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            return (await r.read()).decode()

    text = asyncio.run(_with_proxy([p], [d], run))
    [(path, pre, pid)] = p.got
    assert path == "/v1/chat/completions" and pid == "mine"
    assert pre["max_completion_tokens"] == 1 and pre["max_tokens"] == 1 and "stream_options" not in pre
    assert d.got[0][1]["stream_options"] == {"include_usage": True}
    words = [json.loads(line[5:])["choices"][0]["text"] for line in text.split("\n\n")
             if line.startswith("data:") and line != "data: [DONE]"]
    assert words == ["one", "two", "three"] and text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("status", [500, 404])
def test_a_failed_prefill_step_leaves_a_plain_decode_request(status):
    p, d = FakeEngine("prefill", status=status), FakeEngine("decode")

    async def run(session, url, proxy):
        async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}) as r:
            assert r.status == 200
            return await r.json(), dict(proxy.counters)

    got, counters = asyncio.run(_with_proxy([p], [d], run))
    assert got["got_params"] is None  # computed by the decode engine
    assert counters["prefill_failures"] == 1 and counters["requests"] == 1


def test_a_dead_prefill_engine_leaves_a_plain_decode_request():
    d = FakeEngine("decode")

    async def run(session, url, proxy):
        proxy.prefill.engines[0].url = "http://127.0.0.1:9"  # nothing listens there
        async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}) as r:
            return r.status, await r.json()

    status, got = asyncio.run(_with_proxy([FakeEngine("prefill")], [d], run))
    assert status == 200 and got["got_params"] is None


def test_a_dead_decode_engine_is_an_upstream_error_not_a_hang():
    async def run(session, url, proxy):
        proxy.decode.engines[0].url = "http://127.0.0.1:9"
        async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}) as r:
            return r.status, await r.json()

    status, got = asyncio.run(_with_proxy([FakeEngine("prefill")], [FakeEngine("decode")], run))
    assert status == 502 and got["error"]["type"] == "upstream_error"


def test_requests_go_to_the_engine_with_the_fewest_in_flight():
    hold = asyncio.Event()
    slow, fast = FakeEngine("decode", hold=hold), FakeEngine("decode")

    async def run(session, url, proxy):
        first = asyncio.create_task(session.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}))
        for _ in range(1000):  # the first goes to the first engine (a tie), which holds it
            if slow.got:
                break
            await asyncio.sleep(0.01)
        async with session.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}) as r:
            assert r.status == 200
        hold.set()
        (await first).release()

    asyncio.run(_with_proxy([FakeEngine("prefill")], [slow, fast], run))
    assert [b["prompt"] for _, b, _ in slow.got] == ["a"] and [b["prompt"] for _, b, _ in fast.got] == ["b"]


BS = 16


def _blocks_stored(tokens, tag):
    """vLLM's BlockStored for the whole blocks of `tokens`, as the proxy decodes it."""
    n = len(tokens) // BS
    return [{"type": "BlockStored", "block_hashes": [f"{tag}{i}".encode() for i in range(n)],
             "parent_block_hash": None, "token_ids": tokens[:n * BS], "block_size": BS, "lora_id": None,
             "medium": "GPU", "lora_name": None}]


def test_with_kv_events_a_prefill_engine_is_picked_by_the_blocks_it_must_compute(tmp_path):
    doc = [(31 * i + 7) % 30000 + 100 for i in range(4 * BS + 5)]
    other = [(17 * i + 3) % 30000 + 100 for i in range(4 * BS)]
    cold, warm = FakeEngine("prefill"), FakeEngine("prefill")

    async def run(session, url, proxy):
        index = proxy.prefill.index
        index.apply(proxy.prefill.engines[1].url, _blocks_stored(doc[:3 * BS], "w"))  # warm holds 3 of 4 blocks
        for prompt in (doc, other):
            async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r:
                assert r.status == 200
        async with session.get(url + "/pd/stats") as r:
            return await r.json()

    events = lambda n: [f"ipc://{tmp_path}/e{i}.sock" for i in range(n)]  # noqa: E731 (no publisher: fed here)
    stats = asyncio.run(_with_proxy([cold, warm], [FakeEngine("decode")], run, prefill_events=events))
    # doc: warm computes 1 block, cold 4; other: a tie in blocks (4 + 0 each), the one that served fewer.
    assert [b["prompt"] for _, b, _ in warm.got] == [doc] and [b["prompt"] for _, b, _ in cold.got] == [other]
    assert stats["prompts_matched"] == 2 and stats["prefill_blocks_held"] == 3 and stats["prefill_blocks_new"] == 5
    assert [e["indexed_blocks"] for e in stats["prefill"]] == [0, 3]


def test_with_kv_events_a_busy_engine_loses_to_an_idle_one_that_holds_less(tmp_path):
    doc = [(31 * i + 7) % 30000 + 100 for i in range(4 * BS)]
    other = [(17 * i + 3) % 30000 + 100 for i in range(6 * BS)]
    hold = asyncio.Event()
    busy, idle = FakeEngine("prefill", hold=hold), FakeEngine("prefill")

    async def run(session, url, proxy):
        proxy.prefill.index.apply(proxy.prefill.engines[0].url, _blocks_stored(doc[:2 * BS], "b"))
        first = asyncio.create_task(session.post(url + "/v1/completions", json={"prompt": other, "max_tokens": 2}))
        for _ in range(1000):
            if busy.got:
                break
            await asyncio.sleep(0.01)
        assert proxy.prefill.engines[0].pending_blocks == 6
        # doc on busy: 2 new + 6 pending; on idle: 4 new + 0.
        async with session.post(url + "/v1/completions", json={"prompt": doc, "max_tokens": 2}) as r:
            assert r.status == 200
        hold.set()
        (await first).release()

    events = lambda n: [f"ipc://{tmp_path}/e{i}.sock" for i in range(n)]  # noqa: E731
    asyncio.run(_with_proxy([busy, idle], [FakeEngine("decode")], run, prefill_events=events))
    assert [b["prompt"] for _, b, _ in busy.got] == [other] and [b["prompt"] for _, b, _ in idle.got] == [doc]


def test_bad_bodies_and_health_and_stats():
    async def run(session, url, proxy):
        async with session.post(url + "/v1/completions", data=b"not json") as r:
            bad = (r.status, (await r.json())["error"]["type"])
        async with session.get(url + "/health") as r:
            health = (r.status, await r.json())
        async with session.get(url + "/pd/stats") as r:
            stats = await r.json()
        async with session.get(url + "/v1/models") as r:
            models = await r.json()
        return bad, health, stats, models

    bad, health, stats, models = asyncio.run(_with_proxy([FakeEngine("prefill")], [FakeEngine("decode")], run))
    assert bad == (400, "invalid_request_error")
    assert health[0] == 200 and all(v for role in health[1].values() for v in role.values())
    assert stats["requests"] == 0 and len(stats["prefill"]) == 1 and len(stats["decode"]) == 1
    assert models == {"data": [{"id": "m"}]}


def test_shortest_first_gives_the_prefill_copy_the_prompts_length_as_its_priority():
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    bodies = [{"model": "m", "prompt": list(range(300)), "max_tokens": 8},
              {"model": "m", "prompt": list(range(40)), "max_tokens": 8, "priority": 2},
              {"model": "m", "prompt": "x" * 400, "max_tokens": 8},  # text, no tokenizer: characters / 4
              {"model": "m", "messages": [{"role": "user", "content": "y" * 200}], "max_tokens": 8}]

    async def run(session, url, proxy):
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            async with session.post(url + path, json=body) as r:
                assert r.status == 200

    asyncio.run(_with_proxy([p], [d], run, prefill_order="shortest"))
    assert [b["priority"] for _, b, _ in p.got] == [300, 2 * (1 << 24) + 40, 400 // 4, (4 + 200) // 4]
    assert [b.get("priority") for _, b, _ in d.got] == [None, 2, None, None]  # the decode step as sent


def test_a_prompts_length_estimate_takes_any_nesting():
    from ucm.apps.pd_proxy import _priority

    deep = "z" * 8
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    assert _priority({"prompt": deep}, None) == 2
    assert _priority({"prompt": "abcd" * 10, "priority": True}, None) == 10  # a bool is no priority


def test_in_arrival_order_the_prefill_copy_keeps_the_clients_priority_only():
    p, d = FakeEngine("prefill"), FakeEngine("decode")

    async def run(session, url, proxy):
        for body in ({"model": "m", "prompt": [1, 2, 3], "max_tokens": 8},
                     {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "priority": 5}):
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200

    asyncio.run(_with_proxy([p], [d], run))
    assert [b.get("priority") for _, b, _ in p.got] == [None, 5]


def test_an_engine_that_refuses_priority_gets_the_request_again_in_arrival_order():
    p, d = FakeEngine("prefill", refuse_priority=True), FakeEngine("decode")

    async def run(session, url, proxy):
        for n in (30, 20):
            async with session.post(url + "/v1/completions",
                                    json={"model": "m", "prompt": list(range(n)), "max_tokens": 8}) as r:
                assert r.status == 200
                assert (await r.json())["got_params"] == PARAMS  # the prefill step served, not skipped
        return proxy.counters

    counters = asyncio.run(_with_proxy([p], [d], run, prefill_order="shortest"))
    assert [b.get("priority") for _, b, _ in p.got] == [30, None, None]  # refused once, then never sent
    assert counters["priority_refused"] == 1 and counters["prefill_failures"] == 0


def test_bad_arguments_are_typed_errors():
    with pytest.raises(ConfigError, match="--prefill needs at least one engine URL"):
        EnginePool("prefill", [])
    with pytest.raises(ConfigError, match="--decode URLs must start with http"):
        EnginePool("decode", ["127.0.0.1:8000"])
    with pytest.raises(ConfigError, match=r"--prefill-order must be one of \['arrival', 'shortest'\]"):
        PdProxy(["http://a:1"], ["http://b:2"], prefill_order="fastest")
    with pytest.raises(ConfigError, match="--timeout-s must be > 0"):
        PdProxy(["http://a:1"], ["http://b:2"], timeout_s=0)
    with pytest.raises(ConfigError, match="--prefill-events needs one endpoint per --prefill engine"):
        PdProxy(["http://a:1", "http://a:2"], ["http://b:2"], prefill_events=["ipc:///tmp/x"])
    with pytest.raises(ConfigError, match="an events endpoint is tcp://HOST:PORT"):
        PdProxy(["http://a:1"], ["http://b:2"], decode_events=["tcp://*:5557"])
