"""The scheduler half of UCMConnector, built by its own constructor over
vLLM's real config, request, block and scheduler-output types, with a
scripted cache in place of the service (`_open_cache`, the seam the
connector opens its cache through): token -> block -> page arithmetic,
one-token-short hits, sync/async choice, planned saves, preemption,
invalid blocks, and the bound on what waiting requests pin.

Geometry: vLLM pages of 16 tokens, ucm blocks of 32 tokens (2 pages), two
layers of 2 KV heads x head size 16 in bf16: 2 KiB per layer and page, so
a block is 2 x 2 x 2 KiB = 8 KiB."""
import json
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import ucm.connectors.vllm as uv  # noqa: E402
from ucm.errors import ConfigError  # noqa: E402

PAGE, BLOCK = 16, 32
BLOCK_BYTES = 2 * 2 * 2048
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
          "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}


class ScriptedCache:
    """What the scheduler asks the cache, over a dict key -> tier; pins are
    counted per key and may never go below zero."""

    def __init__(self):
        self.tiers, self.pins, self.finished = {}, Counter(), []

    def lookup(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.tiers:
            n += 1
        return n

    def locate(self, keys):
        return [self.tiers.get(k) for k in keys]

    def pin(self, keys):
        self.pins.update(k for k in keys if k in self.tiers)

    def unpin(self, keys):
        for k in keys:
            assert self.pins[k] > 0, "unpinned a block that was not pinned"
            self.pins[k] -= 1
        self.pins += Counter()

    def finish(self, keys, output_tokens):
        self.finished.append((len(keys), output_tokens))

    def pinned(self):
        return sum(self.pins.values())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


@pytest.fixture(scope="module")
def model_config(model_dir):
    return ModelConfig(model=str(model_dir), skip_tokenizer_init=True)


@pytest.fixture
def make(model_config, monkeypatch):
    caches = []

    def build(**extra):
        cache = ScriptedCache()
        caches.append(cache)
        monkeypatch.setattr(uv, "_open_cache", lambda config: cache)
        ucm_config = {"block_tokens": BLOCK, "tiers": [{"adapter": "dram", "capacity": 64 * BLOCK_BYTES}]}
        ktc = KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.connectors.vllm",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"ucm_config": ucm_config, **extra})
        vllm_config = SimpleNamespace(model_config=model_config, parallel_config=ParallelConfig(),
                                      cache_config=CacheConfig(block_size=PAGE), kv_transfer_config=ktc)
        spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
        kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                               "model.layers.1.self_attn.attn"], spec)])
        conn = uv.UCMConnector(vllm_config, KVConnectorRole.SCHEDULER, kcc)
        return conn, cache

    return build


def _request(req_id, tokens):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8), None)


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


def _cache_prompt(conn, cache, tokens, tiers):
    keys = conn._state(_request("probe", tokens)).keys
    conn._reqs.pop("probe")
    for k, t in zip(keys, tiers):
        cache.tiers[k] = t
    return keys


def test_hit_is_whole_blocks_beyond_the_local_hit_and_one_token_short_of_the_prompt(make):
    conn, cache = make()
    tokens = list(range(100))  # 3 full blocks (96 tokens) and a tail
    keys = _cache_prompt(conn, cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (96, False)
    assert conn.get_num_new_matched_tokens(req, 32) == (64, False)  # memoised, same answer for vLLM's hit
    assert conn.get_num_new_matched_tokens(req, 96) == (0, False)
    assert cache.pins == Counter(keys)  # pinned once, not per call
    full = _request("r2", tokens[:96])
    assert conn.get_num_new_matched_tokens(full, 0) == (95, False)  # vLLM must compute the last token


def test_load_job_maps_tokens_to_blocks_and_pages_skipping_what_vllm_has(make):
    conn, cache = make()
    tokens = list(range(100))
    keys = _cache_prompt(conn, cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    assert conn.get_num_new_matched_tokens(req, 16) == (80, False)  # vLLM holds the first page itself
    pages = [11, 12, 13, 14, 15, 16, 17]
    conn.update_state_after_alloc(req, _blocks(pages), 80)
    meta = conn.build_connector_meta(_output(new=[("r1", pages, 96, 4)]))
    [job] = meta.loads
    assert (job.req_id, job.keys, job.is_async) == ("r1", keys, False)
    assert job.page_ids == [[uv.SKIP, 12], [13, 14], [15, 16]]
    assert meta.stores == []  # the loaded blocks are cached already: nothing to save
    assert conn.build_connector_meta(_output()).loads == []  # shipped once


def test_a_block_below_dram_makes_the_load_async(make):
    conn, cache = make()
    tokens = list(range(70))
    _cache_prompt(conn, cache, tokens, ["dram", "nvme"])
    req = _request("r1", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, True)
    conn.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5]), 64)
    [job] = conn.build_connector_meta(_output()).loads
    assert job.is_async and job.page_ids == [[1, 2], [3, 4]]


def test_saves_are_planned_as_blocks_fill_with_their_pages_and_parent(make):
    conn, cache = make()
    tokens = list(range(110))
    req = _request("r1", tokens)
    keys = conn._state(req).keys
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    pages = [21, 22, 23, 24, 25]
    conn.update_state_after_alloc(req, _blocks(pages), 0)
    meta = conn.build_connector_meta(_output(new=[("r1", pages, 0, 70)]))  # chunked prefill: 70 tokens
    [s1] = meta.stores
    assert (s1.keys, s1.page_ids, s1.parent) == (keys[:2], [[21, 22], [23, 24]], None)
    meta = conn.build_connector_meta(_output(cached=[("r1", [26, 27], 70, 40, False)]))
    [s2] = meta.stores
    assert (s2.keys, s2.page_ids, s2.parent) == (keys[2:3], [[25, 26]], keys[1])
    assert conn.build_connector_meta(_output(cached=[("r1", None, 110, 1, False)])).stores == []
    assert conn.request_finished(req, pages + [26, 27]) == (True, None)  # pages held for the saves
    assert cache.finished == [(3, 0)]


def test_a_block_being_saved_is_a_hit_async_in_auto_mode_and_no_hit_in_sync_mode(make):
    for mode, want in (("auto", (64, True)), ("sync", (0, False))):
        conn, cache = make(ucm_load_mode=mode)
        tokens = list(range(70))
        first = _request("r1", tokens)
        conn.get_num_new_matched_tokens(first, 0)
        conn.update_state_after_alloc(first, _blocks([1, 2, 3, 4, 5]), 0)
        assert len(conn.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5], 0, 70)])).stores) == 1
        # The next turn arrives while that save is in flight.
        assert conn.get_num_new_matched_tokens(_request("r2", tokens), 0) == want, mode


def test_sync_mode_stops_the_hit_at_the_first_block_still_being_saved(make):
    conn, cache = make(ucm_load_mode="sync")
    tokens = list(range(100))
    keys = _cache_prompt(conn, cache, tokens, ["dram"])  # block 0 cached; 1 and 2 are being saved
    conn._saving.update(keys[1:])
    assert conn.get_num_new_matched_tokens(_request("r1", tokens), 0) == (32, False)


def test_preemption_unpins_and_the_resumed_request_looks_up_again_with_its_new_pages(make):
    conn, cache = make()
    tokens = list(range(100))
    keys = _cache_prompt(conn, cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6, 7]), 96)
    conn.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5, 6, 7], 96, 4)]))
    meta = conn.build_connector_meta(_output(preempted={"r1"}))
    assert meta.preempted == {"r1"} and cache.pinned() == 0
    assert conn.get_num_new_matched_tokens(req, 0) == (96, False)  # a fresh lookup, pinned again
    assert cache.pins == Counter(keys)
    conn.update_state_after_alloc(req, _blocks([8, 9, 10, 11, 12, 13, 14]), 96)
    [job] = conn.build_connector_meta(_output(cached=[("r1", [8, 9, 10, 11, 12, 13, 14], 96, 4, True)])).loads
    assert job.page_ids == [[8, 9], [10, 11], [12, 13]]
    conn.request_finished(req, [])
    assert cache.pinned() == 0


def test_invalid_blocks_reset_the_request_and_two_lost_loads_stop_ucm_for_it(make):
    conn, cache = make()
    tokens = list(range(100))
    _cache_prompt(conn, cache, tokens, ["dram"] * 3)
    req = _request("r1", tokens)
    pages = [1, 2, 3, 4, 5, 6, 7]
    for _ in range(2):
        assert conn.get_num_new_matched_tokens(req, 0) == (96, False)
        conn.update_state_after_alloc(req, _blocks(pages), 96)
        conn.build_connector_meta(_output(new=[("r1", pages, 96, 4)]))
        conn.update_connector_output(KVConnectorOutput(invalid_block_ids={4}))  # block 1's second page
        st = conn._reqs["r1"]
        assert (st.next_store, st.looked_up) == (1, False) and cache.pinned() == 0
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # computed without ucm's help
    meta = conn.build_connector_meta(_output(cached=[("r1", None, 0, 100, False)]))
    assert [s.page_ids for s in meta.stores] == [[[3, 4], [5, 6]]]  # the recomputed blocks are saved again


def test_waiting_requests_pin_at_most_the_cap_and_beyond_it_count_as_misses(make):
    conn, cache = make(ucm_max_waiting_pin_bytes=3 * BLOCK_BYTES)
    a_tokens, b_tokens = list(range(70)), list(range(500, 600))
    _cache_prompt(conn, cache, a_tokens, ["dram"] * 2)
    _cache_prompt(conn, cache, b_tokens, ["dram"] * 3)
    a, b = _request("a", a_tokens), _request("b", b_tokens)
    assert conn.get_num_new_matched_tokens(a, 0) == (64, False)  # vLLM has no pages for a: it waits
    assert conn.get_num_new_matched_tokens(b, 0) == (32, False)  # one block of room left
    assert cache.pinned() == 3
    assert conn.get_num_new_matched_tokens(b, 0) == (32, False)  # still no room: no churn
    assert cache.pinned() == 3
    conn.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5]), 64)  # a runs: its pins leave the budget
    assert conn.get_num_new_matched_tokens(b, 0) == (96, False)  # b looks up again, now with room
    assert cache.pinned() == 5
    conn.request_finished(a, [])
    conn.request_finished(b, [])
    assert cache.pinned() == 0 and conn._waiting_pinned == 0


def test_the_only_waiting_request_pins_its_whole_hit_past_the_cap(make):
    """The cap bounds a queue of waiting requests, not one long prompt: with
    no other pins waiting, a hit larger than the cap is served whole."""
    conn, cache = make(ucm_max_waiting_pin_bytes=1 * BLOCK_BYTES)
    a_tokens, b_tokens = list(range(100)), list(range(500, 600))
    _cache_prompt(conn, cache, a_tokens, ["dram"] * 3)
    _cache_prompt(conn, cache, b_tokens, ["dram"] * 3)
    assert conn.get_num_new_matched_tokens(_request("a", a_tokens), 0) == (96, False)
    assert cache.pinned() == 3
    assert conn.get_num_new_matched_tokens(_request("b", b_tokens), 0) == (0, False)  # a waits with 3
    assert cache.pinned() == 3


def test_a_finished_waiting_request_gives_its_pin_budget_back(make):
    conn, cache = make(ucm_max_waiting_pin_bytes=2 * BLOCK_BYTES)
    tokens = list(range(70))
    _cache_prompt(conn, cache, tokens, ["dram"] * 2)
    assert conn.get_num_new_matched_tokens(_request("a", tokens), 0) == (64, False)
    assert conn.get_num_new_matched_tokens(_request("b", tokens), 0) == (0, False)  # no room
    assert conn.request_finished(_request("a", tokens), []) == (False, None)  # aborted while waiting
    assert conn.get_num_new_matched_tokens(_request("b", tokens), 0) == (64, False)


def test_default_pin_cap_is_a_quarter_of_the_landing_tier(make):
    conn, _ = make()
    assert conn._max_waiting_pinned == 64 // 4


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB"])
def test_bad_pin_cap_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"ucm_max_waiting_pin_bytes.*" + str(value).replace(".", r"\.")):
        uv.ConnectorSettings.from_extra({"ucm_max_waiting_pin_bytes": value})


def test_blocks_whose_save_a_preemption_dropped_are_planned_again_on_resume(make):
    conn, cache = make()
    tokens = list(range(100))
    req = _request("r1", tokens)
    keys = conn._state(req).keys
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6, 7]), 0)
    [s] = conn.build_connector_meta(_output(new=[("r1", [1, 2, 3, 4, 5, 6, 7], 0, 100)])).stores
    assert s.keys == keys
    cache.tiers[keys[0]] = "dram"  # the worker saved block 0; the preemption dropped blocks 1 and 2
    conn.build_connector_meta(_output(preempted={"r1"}))
    conn.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert conn.get_num_new_matched_tokens(req, 0) == (32, False)
    conn.update_state_after_alloc(req, _blocks([8, 9, 10, 11, 12, 13, 14]), 32)
    meta = conn.build_connector_meta(_output(cached=[("r1", [8, 9, 10, 11, 12, 13, 14], 32, 68, True)]))
    [s] = meta.stores
    assert (s.keys, s.page_ids, s.parent) == (keys[1:], [[10, 11], [12, 13]], keys[0])
