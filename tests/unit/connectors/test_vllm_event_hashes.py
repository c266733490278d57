"""ucm's KV events in vLLM's own terms (ucm.connectors.vllm.kv_events):
the page hashes are those vLLM's request block hasher computes for the
same tokens and context, and the events round-trip through vLLM's msgspec
types as its ZMQ publisher sends them."""
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

PAGE = 128


def vllm_config(algo="sha256"):
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=PAGE, prefix_caching_hash_algo=algo),
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=True))


def vllm_hashes(tokens, algo, cache_salt=None, lora=None):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    req = Request("r", list(map(int, tokens)), SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                  lora_request=lora, block_hasher=get_request_block_hasher(PAGE, fn))
    return list(req.block_hashes), req


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salted", [False, True])
def test_page_hashes_are_the_engines_own(algo, salted):
    from vllm.lora.request import LoRARequest

    from ucm.connectors.vllm.kv_events import page_hasher, request_extra

    tokens = np.random.default_rng(0).integers(0, 40000, size=4 * PAGE, dtype=np.uint32)
    lora = LoRARequest("adapter", 1, "/path/to/adapter") if salted else None
    want, req = vllm_hashes(tokens, algo, cache_salt="tenant" if salted else None, lora=lora)
    hash_pages = page_hasher(vllm_config(algo))
    extra = request_extra(req)
    assert (extra is not None) == salted
    first = hash_pages(None, tokens[:2 * PAGE], extra, True)  # a ucm block of two pages
    second = hash_pages(first[-1], tokens[2 * PAGE:], extra, False)
    assert first + second == want


def test_events_round_trip_through_vllms_msgspec_types():
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from ucm.connectors.kv_events import Removed, Stored
    from ucm.connectors.vllm.kv_events import to_vllm_events

    tokens = np.arange(2 * PAGE, dtype=np.uint32)
    h = [b"\x01" * 32, b"\x02" * 32]
    events = to_vllm_events([Stored(h, None, tokens, {"cache_salt": "s"}, "CPU_TIER1"),
                             Stored([b"\x03" * 32], h[-1], tokens[:PAGE], None, "DISK"),
                             Removed(h, "CPU_TIER1")], PAGE)
    wire = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    got = msgspec.msgpack.Decoder(type=KVEventBatch).decode(wire).events
    assert [type(e) for e in got] == [BlockStored, BlockStored, BlockRemoved]
    a, b, c = got
    h = [maybe_convert_block_hash(x) for x in h]  # as the engine publishes its own (ints by default)
    assert a.block_hashes == h and a.parent_block_hash is None and a.token_ids == list(range(2 * PAGE))
    assert a.block_size == PAGE and a.medium == "CPU_TIER1" and a.extra_keys == [("s",), None]
    assert b.parent_block_hash == h[-1] and b.medium == "DISK" and b.extra_keys is None
    assert c.block_hashes == h and c.medium == "CPU_TIER1"


def test_no_events_unless_vllm_publishes_them_and_the_cache_keeps_a_catalog():
    from connector_fakes import FakeCache

    from ucm.connectors.vllm.kv_events import events_for
    from ucm.keys import Namespace

    ns = Namespace(model="m", kv_dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64, block_tokens=256)
    assert events_for(vllm_config(), FakeCache(), ns) is not None
    assert events_for(vllm_config(), object(), ns) is None  # a CacheAPI without describe/events/holdings
    cfg = vllm_config()
    cfg.kv_events_config.enable_kv_cache_events = False
    assert events_for(cfg, object(), Namespace(model="m", kv_dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64, block_tokens=256)) is None
    cfg.kv_events_config = None
    assert events_for(cfg, object(), Namespace(model="m", kv_dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64, block_tokens=256)) is None


def test_the_scheduler_describes_the_blocks_it_saves_and_publishes_the_caches_changes():
    """The scheduler side with KV events on, over a real cache: the saves it
    plans describe their blocks (tokens, parents, the request's salt), and
    once the blocks are held take_events answers vLLM BlockStored events with
    the engine's own hashes of the request's pages."""
    from vllm import SamplingParams
    from vllm.distributed.kv_events import BlockStored
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.request import Request

    from ucm.cache.unified import UnifiedCache
    from ucm.connectors.kv_events import TierEventReader
    from ucm.connectors.vllm.kv_events import EngineEvents, page_hasher, request_seed
    from ucm.connectors.vllm.scheduler import UCMSchedulerSide
    from ucm.keys import Namespace

    init_none_hash(get_hash_fn_by_name("sha256"))
    ns = Namespace(model="test-model", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16,
                   block_tokens=2 * PAGE, layout=f"vllm-cpu-page{PAGE}")
    with UnifiedCache({"block_tokens": 2 * PAGE, "tiers": [{"adapter": "dram", "capacity": "4MiB"}]}) as cache:
        cache.catalog.min_sweep_s, cache.catalog.sweep_share = 0, 1.0
        side = UCMSchedulerSide(cache, ns, page_tokens=PAGE, landing_tier="dram", max_waiting_pin_blocks=8)
        reader = TierEventReader(cache, lambda extra: request_seed(ns, (extra or {}).get("cache_salt"), None),
                                 2 * PAGE, page_hasher(vllm_config()), threaded=False)
        side.events = EngineEvents(reader, PAGE)
        tokens = list(range(5, 5 + 3 * 2 * PAGE + 7))
        req = Request("r1", tokens, SamplingParams(max_tokens=4), None, cache_salt="tenant",
                      block_hasher=get_request_block_hasher(PAGE, get_hash_fn_by_name("sha256")))
        keys = side.request_keys(req)
        side.get_num_new_matched_tokens(req, 0)
        pages = list(range(10, 17))
        side.update_state_after_alloc(req, _blocks(pages), 0)
        [job] = side.build_connector_meta(_output(new=[("r1", pages, 0, len(tokens))])).stores
        reader.poll()  # the descriptions reach the cache
        cache.store(job.keys, [bytes(1024)] * len(job.keys)).wait(10)
        reader.poll()
        events = side.take_events()
        assert [type(e) for e in events] == [BlockStored] * 3 and keys == job.keys
        assert [h for e in events for h in e.block_hashes] == [maybe_convert_block_hash(h) for h in req.block_hashes]
        assert [t for e in events for t in e.token_ids] == tokens[:3 * 2 * PAGE]
        assert events[0].extra_keys == [("tenant",), None] and events[0].medium == "CPU_TIER1"
        assert side.take_events() == []


def _blocks(page_ids):
    from test_vllm_scheduler import _blocks as blocks

    return blocks(page_ids)


def _output(**kw):
    from test_vllm_scheduler import _output as output  # vLLM's SchedulerOutput, as the scheduler tests build it

    return output(**kw)
