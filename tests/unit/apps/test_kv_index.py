"""Which engine holds which prompt prefix (ucm/apps/kv_index.py), from KV
events in vLLM's own classes and wire format: stored, removed and cleared
blocks on GPU and in ucm's tiers, blocks it must not index, a restarted
engine, and the feed from vLLM's own ZMQ publisher on 127.0.0.1; and a
request's prompt as token ids (ucm/apps/prompt_tokens.py) as vLLM's server
makes it."""
import socket
import time

import pytest

msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from ucm.apps.kv_index import EventFeed, PrefixIndex, prefix_keys  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

BS = 16
PROMPT = [(37 * i + 5) % 30000 + 100 for i in range(4 * BS + 3)]


def _as_wire(*events):
    """The events as the proxy receives them: vLLM's msgpack, decoded generically."""
    import msgpack

    return msgpack.unpackb(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events))), raw=False)[1]


def _stored(hashes, parent, first_block, medium="GPU", tokens=PROMPT, **extra):
    body = tokens[first_block * BS:(first_block + len(hashes)) * BS]
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=body, block_size=BS, lora_id=None,
                       medium=medium, lora_name=None, **extra)


def test_blocks_stored_removed_and_moved_are_matched_by_their_tokens_not_the_engines_hashes():
    index = PrefixIndex(["a", "b"])
    # a holds the first three blocks on GPU, b only the first: different hash functions, same tokens.
    index.apply("a", _as_wire(_stored([b"a0", b"a1"], None, 0), _stored([b"a2"], b"a1", 2)))
    index.apply("b", _as_wire(_stored([11], None, 0)))
    assert index.match(PROMPT) == {"a": (3, 3), "b": (1, 1)}
    assert index.match(PROMPT[:2 * BS + 5]) == {"a": (2, 2), "b": (1, 1)}
    assert index.match([1] + PROMPT[1:]) == {"a": (0, 0), "b": (0, 0)}  # another first block: nothing
    # a's block 1 leaves its GPU and ucm holds it (its connector's CPU event): held, not on GPU.
    index.apply("a", _as_wire(BlockRemoved(block_hashes=[b"a1"], medium="GPU")))
    assert index.match(PROMPT)["a"] == (1, 1)
    index.apply("a", _as_wire(_stored([b"a1"], b"a0", 1, medium="CPU")))
    assert index.match(PROMPT)["a"] == (1, 3)
    index.apply("a", _as_wire(BlockRemoved(block_hashes=[b"a1"], medium="CPU"), AllBlocksCleared()))
    assert index.match(PROMPT) == {"a": (0, 0), "b": (1, 1)}
    assert index.blocks("a") == 0 and index.counts["cleared"] == 1


def test_blocks_it_cannot_key_are_skipped_never_guessed():
    index = PrefixIndex(["a"])
    index.apply("a", _as_wire(
        _stored([b"x1"], b"unknown-parent", 1),  # its parent never seen: no place in the chain
        _stored([b"s0"], None, 0, extra_keys=[("salt",)]),  # a cache salt: another request's blocks
        BlockStored(block_hashes=[b"l0"], parent_block_hash=None, token_ids=PROMPT[:BS], block_size=BS, lora_id=3,
                    medium="GPU", lora_name="adapter"),
        _stored([b"g0"], None, 0, group_idx=1),  # another KV cache group
        _stored([b"t0", b"t1"], None, 0, tokens=PROMPT[:BS]),  # tokens short of two blocks
    ))
    assert index.match(PROMPT) == {"a": (0, 0)}
    assert index.counts["skipped"] == 6 and index.counts["stored"] == 0
    index.apply("a", [{"type": "Nonsense"}, {"no": "type"}, {"type": "BlockStored", "block_size": "x"}])
    assert index.counts["malformed"] == 3


def test_a_sequence_number_that_goes_back_is_a_restarted_engine_and_forgets_its_blocks():
    index = PrefixIndex(["a"])
    index.apply("a", _as_wire(_stored([b"a0"], None, 0)), seq=5)
    index.apply("a", _as_wire(_stored([b"a1"], b"a0", 1)), seq=6)
    assert index.match(PROMPT)["a"] == (2, 2)
    index.apply("a", _as_wire(_stored([b"z0"], None, 0, tokens=[7] * BS)), seq=0)
    assert index.match(PROMPT)["a"] == (0, 0) and index.counts["restarts"] == 1


def test_prefix_keys_chain_whole_blocks_only():
    keys = prefix_keys(PROMPT, BS)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert prefix_keys(PROMPT[:BS - 1], BS) == []
    assert prefix_keys([PROMPT[0] + 1] + PROMPT[1:], BS)[1] != keys[1]  # a block's key depends on all before it
    assert prefix_keys(PROMPT[BS:], BS, keys[0]) == keys[1:]  # a chain goes on from a block's key
    index = PrefixIndex(["a"])
    index.apply("a", _as_wire(_stored([b"a0"], None, 0)))
    assert index.match([-1] + PROMPT[1:]) == {"a": (0, 0)}  # ids no key takes: nothing held, no error
    index.apply("a", _as_wire(_stored([b"bad"], None, 0, tokens=[-1] + PROMPT[1:BS])))
    assert index.counts["skipped"] == 1  # an event with such ids: skipped, the feed goes on


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_feed_follows_vllms_own_publisher():
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    index = PrefixIndex(["a"])
    feed = EventFeed(index, {"a": "bind:" + endpoint}, poll_ms=20)  # vLLM connects to a concrete host
    pub = ZmqEventPublisher(0, endpoint=endpoint)
    try:
        deadline = time.monotonic() + 20
        while index.match(PROMPT)["a"] != (2, 2):  # a SUB misses what is sent before it joined: send again
            assert time.monotonic() < deadline, index.counts
            pub.publish(KVEventBatch(ts=time.time(), events=[_stored([b"a0", b"a1"], None, 0)]))
            time.sleep(0.1)
        assert index.counts["malformed"] == 0 and index.counts["restarts"] == 0
    finally:
        pub.shutdown()
        feed.close()


def test_the_feed_connects_to_an_endpoint_vllm_binds(tmp_path):
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = f"ipc://{tmp_path}/events.sock"
    pub = ZmqEventPublisher(0, endpoint=endpoint)
    index = PrefixIndex(["a"])
    feed = EventFeed(index, {"a": endpoint}, poll_ms=20)
    try:
        deadline = time.monotonic() + 20
        while index.match(PROMPT)["a"] != (1, 1):
            assert time.monotonic() < deadline, index.counts
            pub.publish(KVEventBatch(ts=time.time(), events=[_stored([b"a0"], None, 0)]))
            time.sleep(0.1)
    finally:
        pub.shutdown()
        feed.close()


def test_bad_endpoints_are_config_errors():
    for bad in ("127.0.0.1:5557", "tcp://*:5557", "bind:http://x"):
        with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
            EventFeed(PrefixIndex(["a"]), {"a": bad})
    with pytest.raises(ConfigError, match="cannot be bound"):
        EventFeed(PrefixIndex(["a"]), {"a": "bind:tcp://192.0.2.1:5557"})


# ---- prompts as token ids -----------------------------------------------------------
def _model_dir():
    from ucm.apps.model import model_dir

    d = model_dir("smollm2")
    if not (d / "tokenizer.json").is_file():
        pytest.skip(f"{d} missing: run `ucm model prepare smollm2`")
    return d


def test_prompts_are_tokenized_as_vllms_server_tokenizes_them():
    from transformers import AutoTokenizer

    from ucm.apps.prompt_tokens import PromptTokens

    d = _model_dir()
    ref = AutoTokenizer.from_pretrained(str(d))
    p = PromptTokens(str(d))
    text = "The cache holds what the engine computed. " * 5
    assert p.tokens("/v1/completions", {"prompt": text}) == ref(text).input_ids
    assert p.tokens("/v1/completions", {"prompt": [text]}) == ref(text).input_ids
    assert p.tokens("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why cache KV?"}]
    assert p.tokens("/v1/chat/completions", {"messages": messages}) == \
        ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    # What it cannot tell is None: several prompts, a foreign template, no messages.
    assert p.tokens("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert p.tokens("/v1/chat/completions", {"messages": messages, "chat_template": "{{ x }}"}) is None
    assert p.tokens("/v1/chat/completions", {}) is None


def test_without_a_tokenizer_only_token_prompts_are_known(tmp_path):
    from ucm.apps.prompt_tokens import PromptTokens

    p = PromptTokens()
    assert p.tokens("/v1/completions", {"prompt": [1, 2]}) == [1, 2]
    assert p.tokens("/v1/completions", {"prompt": "text"}) is None
    assert p.tokens("/v1/completions", {"prompt": [True, 2]}) is None
    with pytest.raises(ConfigError, match="--tokenizer"):
        PromptTokens(str(tmp_path))
