"""The scheduler half of UCMConnector (UCMSchedulerSide), built directly over
a FakeCache and driven with vLLM's real Request, KVCacheBlocks,
SchedulerOutput and KVConnectorOutput objects: token -> block -> page
arithmetic, one-token-short hits, sync/async choice, planned saves, request
events, pins and settings (a request's life after its lookup:
test_vllm_scheduler_lifecycle.py).

Geometry: vLLM's CPU pages of 128 tokens, ucm blocks of 256 tokens (2
pages) unless a test says otherwise."""
from collections import Counter

import pytest

pytest.importorskip("vllm")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from connector_fakes import FakeCache  # noqa: E402
from ucm.api import CacheAPI  # noqa: E402
from ucm.connectors.kv_pages import SKIP  # noqa: E402
from ucm.connectors.vllm.scheduler import UCMSchedulerSide  # noqa: E402
from ucm.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402
from ucm.keys import Namespace, block_keys  # noqa: E402

PAGE, BLOCK = 128, 256


def _namespace(block_tokens=BLOCK):
    return Namespace(model="test-model", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16,
                     block_tokens=block_tokens, layout=f"vllm-cpu-page{PAGE}")


def _side(cap_blocks=16, block_tokens=BLOCK, **settings):
    cache = FakeCache()
    side = UCMSchedulerSide(cache, _namespace(block_tokens), page_tokens=PAGE, landing_tier="dram",
                            max_waiting_pin_blocks=cap_blocks, settings=ConnectorSettings(**settings))
    return side, cache


def _request(req_id, tokens, **kw):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8), None, **kw)


def _blocks(page_ids):
    return KVCacheBlocks(blocks=([KVCacheBlock(p) for p in page_ids],))


def _output(new=(), cached=(), preempted=None):
    """new: (req_id, page_ids, num_computed, scheduled); cached: (req_id,
    new_page_ids or None, num_computed, scheduled, resumed)."""
    cd = CachedRequestData.make_empty()
    for req_id, pages, computed, _, resumed in cached:
        cd.req_ids.append(req_id)
        cd.new_block_ids.append((list(pages),) if pages is not None else None)
        cd.num_computed_tokens.append(computed)
        cd.num_output_tokens.append(0)
        if resumed:
            cd.resumed_req_ids.add(req_id)
    sched = {r[0]: r[3] for r in list(new) + list(cached)}
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=r, prompt_token_ids=None, mm_features=[], sampling_params=None,
                                           pooling_params=None, block_ids=(list(p),), num_computed_tokens=c,
                                           lora_request=None) for r, p, c, _ in new],
        scheduled_cached_reqs=cd, num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
        finished_req_ids=set(), free_encoder_mm_hashes=[], preempted_req_ids=preempted)


def _cache(cache, tokens, tiers, block_tokens=BLOCK):
    """Puts the leading full blocks of `tokens` into `cache`, one per tier
    given; returns every full block's key."""
    keys = block_keys(_namespace(block_tokens), tokens)
    for k, t in zip(keys, tiers):
        cache.tiers[k] = t
    return keys


def test_the_fake_is_a_cache_api():
    assert isinstance(FakeCache(), CacheAPI)


def test_keys_are_the_prompts_full_blocks_under_the_namespace():
    side, _ = _side()
    tokens = list(range(700))  # 2 full blocks of 256 and a partial one of 188 tokens
    assert side.request_keys(_request("r", tokens)) == block_keys(_namespace(), tokens[:512])
    assert len(side.request_keys(_request("r", tokens))) == 2
    salted = side.request_keys(_request("r", tokens, cache_salt="tenant-a"))
    assert len(salted) == 2 and not set(salted) & set(block_keys(_namespace(), tokens))


@pytest.mark.parametrize("block_tokens", [128, 256, 512])
def test_hit_is_whole_blocks_beyond_vllms_own_hit(block_tokens):
    side, cache = _side(block_tokens=block_tokens)
    tokens = list(range(1100))  # 1024 tokens in full blocks of every size, and a tail
    nblocks = 1024 // block_tokens
    _cache(cache, tokens, ["dram"] * nblocks, block_tokens)
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (1024, False)
    assert side.get_num_new_matched_tokens(req, 128) == (1024 - 128, False)  # vLLM holds one page itself
    assert side.get_num_new_matched_tokens(req, 1024) == (0, False)  # nothing beyond vLLM's hit


def test_the_partial_last_block_is_never_a_hit():
    side, cache = _side()
    tokens = list(range(600))  # blocks [0, 256), [256, 512); 88 tokens left over
    _cache(cache, tokens, ["dram", "dram"])
    assert side.get_num_new_matched_tokens(_request("r1", tokens), 0) == (512, False)


def test_a_full_hit_is_reported_one_token_short_of_the_prompt():
    side, cache = _side()
    tokens = list(range(512))  # exactly two blocks, both cached
    _cache(cache, tokens, ["dram", "dram"])
    assert side.get_num_new_matched_tokens(_request("r1", tokens), 0) == (511, False)
    # ...which still loads both blocks: the last page holds the token vLLM recomputes.
    side.update_state_after_alloc(_request("r1", tokens), _blocks([3, 4, 5, 6]), 511)
    [job] = side.build_connector_meta(_output()).loads
    assert job.page_ids == [[3, 4], [5, 6]]


def test_a_hit_stops_at_the_first_missing_block():
    side, cache = _side()
    tokens = list(range(1024))
    keys = _cache(cache, tokens, ["dram"] * 4)
    del cache.tiers[keys[2]]
    assert side.get_num_new_matched_tokens(_request("r1", tokens), 0) == (512, False)
    assert cache.pins == Counter(keys[:2])


def test_the_answer_is_memoised_and_pinned_once():
    side, cache = _side()
    tokens = list(range(800))
    keys = _cache(cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    for _ in range(3):
        assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    cache.tiers.clear()  # vLLM asks again: the memoised, pinned answer stands
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    assert cache.pins == Counter(keys)


def test_load_job_maps_tokens_to_blocks_and_pages_skipping_what_vllm_has():
    side, cache = _side()
    tokens = list(range(800))
    keys = _cache(cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 128) == (640, False)  # vLLM holds the first page itself
    pages = [11, 12, 13, 14, 15, 16, 17]
    side.update_state_after_alloc(req, _blocks(pages), 640)
    meta = side.build_connector_meta(_output(new=[("r1", pages, 768, 32)]))
    [job] = meta.loads
    assert (job.req_id, job.keys, job.is_async) == ("r1", keys, False)
    assert job.page_ids == [[SKIP, 12], [13, 14], [15, 16]]
    assert meta.stores == []  # the loaded blocks are cached already: nothing to save
    assert side.build_connector_meta(_output()).loads == []  # shipped once


def test_a_page_aligned_local_hit_inside_a_block_loads_only_the_rest_of_it():
    side, cache = _side()
    tokens = list(range(1100))
    keys = _cache(cache, tokens, ["dram"] * 4)
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 384) == (640, False)  # vLLM has 3 pages: 1.5 blocks
    side.update_state_after_alloc(req, _blocks(list(range(20, 29))), 640)
    [job] = side.build_connector_meta(_output()).loads
    assert job.keys == keys[1:4]
    assert job.page_ids == [[SKIP, 23], [24, 25], [26, 27]]


def test_no_external_tokens_plans_no_load():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "dram"])
    req = _request("r1", tokens)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 0)  # vLLM chose not to load
    assert side.build_connector_meta(_output()).loads == []


def test_a_block_below_dram_makes_the_load_async_and_reports_a_disk_hit():
    side, cache = _side(load_streaming="off")
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "nvme"])
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (512, True)
    assert side.get_external_cache_hit_sources(req, 512) == {CacheHitSource.DISK: 512}
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 512)
    [job] = side.build_connector_meta(_output()).loads
    assert job.is_async and not job.stream and job.page_ids == [[1, 2], [3, 4]]


@pytest.mark.parametrize("streaming,tiers,want", [
    ("auto", ["dram", "nvme"], (False, True)),   # below DRAM: streamed under the forward
    ("auto", ["dram", "dram"], (False, False)),  # all in DRAM: copied whole before it
    ("on", ["dram", "dram"], (False, True)),
    ("off", ["dram", "nvme"], (True, False)),
])
def test_load_streaming_decides_how_a_hit_is_loaded(streaming, tiers, want):
    side, cache = _side(load_streaming=streaming)
    tokens = list(range(600))
    _cache(cache, tokens, tiers)
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (512, want[0])
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 512)
    [job] = side.build_connector_meta(_output()).loads
    assert (job.is_async, job.stream) == want and job.page_ids == [[1, 2], [3, 4]]


def test_a_block_still_being_saved_is_never_streamed():
    from ucm.connectors.vllm.load_choice import PENDING, choose_load

    assert choose_load(["dram", PENDING], "dram", "auto", "on") == (True, False)
    assert choose_load(["nvme"], "dram", "sync", "auto") == (False, False)


def test_a_dram_hit_is_synchronous_and_a_host_hit():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "dram"])
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (512, False)
    assert side.get_external_cache_hit_sources(req, 512) == {CacheHitSource.HOST: 512}
    assert side.get_external_cache_hit_sources(req, 0) == {}


@pytest.mark.parametrize("mode,want", [("sync", (512, False)), ("async", (512, True))])
def test_a_forced_load_mode_wins_over_the_tier(mode, want):
    side, cache = _side(load_mode=mode)
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "nvme"])
    assert side.get_num_new_matched_tokens(_request("r1", tokens), 0) == want


def test_saves_are_planned_as_blocks_fill_with_their_pages_and_parent():
    side, cache = _side()
    tokens = list(range(880))  # 3 full blocks and 112 tokens that are never saved
    req = _request("r1", tokens)
    keys = side.request_keys(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    pages = [21, 22, 23, 24, 25]
    side.update_state_after_alloc(req, _blocks(pages), 0)
    meta = side.build_connector_meta(_output(new=[("r1", pages, 0, 560)]))  # chunked prefill: 560 tokens
    [s1] = meta.stores
    assert (s1.keys, s1.page_ids, s1.parent) == (keys[:2], [[21, 22], [23, 24]], None)
    meta = side.build_connector_meta(_output(cached=[("r1", [26, 27], 560, 320, False)]))
    [s2] = meta.stores
    assert (s2.keys, s2.page_ids, s2.parent) == (keys[2:3], [[25, 26]], keys[1])
    # Decode: the tail block fills with output tokens; prompt blocks only are saved.
    assert side.build_connector_meta(_output(cached=[("r1", [28], 880, 200, False)])).stores == []
    assert side.request_finished(req, pages + [26, 27, 28]) == (True, None)  # pages held for the saves


def test_a_request_with_no_save_gives_its_pages_back_at_once():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "dram"])
    req = _request("r1", tokens)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 512)
    assert side.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5], 512, 88)])).stores == []
    assert side.request_finished(req, [1, 2, 3, 4, 5]) == (False, None)


def test_a_request_is_begun_once_and_finished_with_its_id_and_output_length():
    side, cache = _side()
    tokens = list(range(600))
    _cache(cache, tokens, ["dram", "dram"])
    req = _request("r1", tokens)
    for computed in (0, 0, 256):
        side.get_num_new_matched_tokens(req, computed)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 512)
    side.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5], 512, 88)]))
    side.build_connector_meta(_output(preempted={"r1"}))
    side.get_num_new_matched_tokens(req, 0)  # resumed: looked up again, not begun again
    req.append_output_token_ids([7, 8, 9])
    side.request_finished(req, [])
    assert cache.events == [("begin", "r1", 2), ("finish", "r1", 2, 3)]


def test_a_prompt_shorter_than_a_block_touches_nothing():
    side, cache = _side()
    req = _request("r1", range(200))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, _blocks([1, 2]), 0)
    assert side.build_connector_meta(_output(new=[("r1", [1, 2], 0, 200)])).stores == []
    assert side.request_finished(req, [1, 2]) == (False, None)
    assert cache.events == [] and cache.pinned() == 0


def test_prompt_embeddings_are_neither_looked_up_nor_saved():
    import torch

    side, cache = _side()
    req = Request("r1", None, SamplingParams(max_tokens=8), None, prompt_embeds=torch.zeros(600, 8))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 0)
    assert side.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5], 0, 600)])).stores == []
    assert cache.events == []


def test_pins_are_released_when_the_request_finishes():
    side, cache = _side()
    tokens = list(range(800))
    keys = _cache(cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    side.get_num_new_matched_tokens(req, 0)
    assert cache.pins == Counter(keys)
    side.update_state_after_alloc(req, _blocks(list(range(7))), 768)
    side.request_finished(req, list(range(7)))
    assert cache.pinned() == 0


def test_a_block_that_vanishes_while_pinning_is_not_promised():
    side, cache = _side()
    tokens = list(range(800))
    keys = _cache(cache, tokens, ["dram"] * 3)
    pin = cache.pin

    def pin_and_lose_the_last(ks):  # evicted between the lookup and the pin
        cache.tiers.pop(keys[2], None)
        pin(ks)

    cache.pin = pin_and_lose_the_last
    assert side.get_num_new_matched_tokens(_request("r1", tokens), 0) == (512, False)
    assert cache.pins == Counter(keys[:2])


def test_a_block_being_saved_is_a_hit_async_in_auto_mode_and_no_hit_in_sync_mode():
    for mode, want in (("auto", (512, True)), ("sync", (0, False))):
        side, cache = _side(load_mode=mode)
        tokens = list(range(600))
        first = _request("r1", tokens)
        side.get_num_new_matched_tokens(first, 0)
        side.update_state_after_alloc(first, _blocks([1, 2, 3, 4, 5]), 0)
        assert len(side.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5], 0, 600)])).stores) == 1
        # The next turn arrives while that save is in flight.
        assert side.get_num_new_matched_tokens(_request("r2", tokens), 0) == want, mode
        # Once the worker reports the save, a newcomer asks the cache itself.
        side.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
        assert side.get_num_new_matched_tokens(_request("r3", tokens), 0) == (0, False), mode


def test_sync_mode_stops_the_hit_at_the_first_block_still_being_saved():
    side, cache = _side(load_mode="sync")
    tokens = list(range(800))
    _cache(cache, tokens, ["dram"])  # block 0 was saved (and reported) before
    first = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(first, 0) == (256, False)
    side.update_state_after_alloc(first, _blocks(list(range(7))), 256)
    [s] = side.build_connector_meta(_output(new=[("r1", list(range(7)), 256, 544)])).stores
    assert s.keys == side.request_keys(first)[1:]  # blocks 1 and 2: in flight now
    assert side.get_num_new_matched_tokens(_request("r2", tokens), 0) == (256, False)


def test_a_block_that_is_not_whole_pages_is_refused():
    with pytest.raises(ConfigError, match=r"block_tokens: 200 is not a multiple of .* 128"):
        UCMSchedulerSide(FakeCache(), _namespace(200), page_tokens=PAGE, landing_tier="dram",
                         max_waiting_pin_blocks=4)


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB"])
def test_bad_pin_cap_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"ucm_max_waiting_pin_bytes.*" + str(value).replace(".", r"\.")):
        ConnectorSettings.from_extra({"ucm_max_waiting_pin_bytes": value})


@pytest.mark.parametrize("extra,match", [({"ucm_load_mode": "eager"}, r"ucm_load_mode: 'eager' not one of"),
                                         ({"ucm_load_timeout_s": 0}, r"ucm_load_timeout_s must be a number > 0"),
                                         ({"ucm_bogus": 1}, r"unknown key 'ucm_bogus'")])
def test_bad_settings_are_refused_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.from_extra(extra)


def test_keys_of_other_connectors_are_ignored():
    assert ConnectorSettings.from_extra({"lmcache_chunk": 5, "ucm_load_mode": "sync"}).load_mode == "sync"
