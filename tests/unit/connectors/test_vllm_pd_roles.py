"""Prefill/decode disaggregation in UCMConnector (ucm/connectors/vllm/pd.py):
the prefill side returns the keys of the blocks it saved in its finished
request's kv_transfer_params; the decode side claims exactly those blocks
(its own keys of the same prompt) as an asynchronous load whose worker
waits for them to be committed, bounded, and otherwise lets vLLM compute
them; params it cannot use make a plain request with a typed warning.

Scheduler tests drive UCMSchedulerSide with vLLM's real Request and
SchedulerOutput over a FakeCache; worker tests run two UCMWorkerSides
(a prefill engine's and a decode engine's) over one FakeCache, as two
engines over one node's service. Geometry: pages of 128 tokens, blocks of
256 (scheduler), 2 pages per block (worker)."""
import threading
import time

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from connector_fakes import JOIN_S, FakeCache  # noqa: E402
from ucm.connectors.vllm.metadata import LoadJob, StoreJob, UCMConnectorMetadata  # noqa: E402
from ucm.connectors.vllm.pd import named_blocks, producer_params  # noqa: E402
from ucm.connectors.vllm.scheduler import UCMSchedulerSide  # noqa: E402
from ucm.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from ucm.connectors.vllm.worker import UCMWorkerSide  # noqa: E402
from ucm.errors import ConfigError, TransferParamsWarning  # noqa: E402
from ucm.keys import Namespace, block_keys  # noqa: E402

PAGE, BLOCK = 128, 256
TOKENS = list(range(1000, 1700))  # 2 full blocks of 256 and a partial one of 188 tokens


def _namespace(model="test-model"):
    return Namespace(model=model, kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16,
                     block_tokens=BLOCK, layout=f"vllm-cpu-page{PAGE}")


def _side(can_load=True, can_save=True, cache=None, **settings):
    cache = cache if cache is not None else FakeCache()
    side = UCMSchedulerSide(cache, _namespace(), page_tokens=PAGE, landing_tier="dram", max_waiting_pin_blocks=16,
                            settings=ConnectorSettings(**settings), can_load=can_load, can_save=can_save)
    return side, cache


def _request(req_id, tokens=TOKENS, params=None):
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8, extra_args=extra), None)


def _prefill_step(side, req_id, pages):
    """The step that computes the whole prompt of `req_id` on `pages`."""
    return side.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=req_id, prompt_token_ids=None, mm_features=[], sampling_params=None,
                                           pooling_params=None, block_ids=(list(pages),), num_computed_tokens=0,
                                           lora_request=None)],
        scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={req_id: len(TOKENS)},
        total_num_scheduled_tokens=len(TOKENS), scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0], finished_req_ids=set(), free_encoder_mm_hashes=[]))


def _finish(side, req, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    req.status = status
    return side.request_finished(req, [])


# ---- the params -----------------------------------------------------------------
def test_producer_params_name_the_blocks_in_order_and_the_tokens_they_cover():
    keys = block_keys(_namespace(), TOKENS)
    params = producer_params(keys, BLOCK)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["ucm_blocks"] == [k.hex() for k in keys] and params["remote_num_tokens"] == 2 * BLOCK
    assert named_blocks(params, keys, "r") == 2
    assert named_blocks({**params, "ucm_blocks": params["ucm_blocks"][:1]}, keys, "r") == 1


@pytest.mark.parametrize("blocks, why", [
    ("ab" * 16, "must be a list of block keys in hex"),
    ([1, 2], "must be a list of block keys in hex"),
    (None, "must be a list of block keys in hex"),
    (["00" * 16] * 3, "names 3 blocks, but the prompt has 2 full blocks"),
    (["00" * 16], "block 0 .* is not this prompt's block"),
])
def test_params_that_cannot_be_used_are_a_typed_warning_and_name_no_block(blocks, why):
    keys = block_keys(_namespace(), TOKENS)
    with pytest.warns(TransferParamsWarning, match=f"request r7: kv_transfer_params.ucm_blocks {why}"):
        assert named_blocks({"do_remote_prefill": True, "ucm_blocks": blocks}, keys, "r7") == 0


def test_another_models_blocks_are_foreign():
    theirs = producer_params(block_keys(_namespace("other-model"), TOKENS), BLOCK)
    with pytest.warns(TransferParamsWarning, match=r"block 0 .*\(another model, prompt, salt or block size\)"):
        assert named_blocks(theirs, block_keys(_namespace(), TOKENS), "r") == 0


def test_params_of_other_connectors_or_none_are_not_a_pd_request():
    keys = block_keys(_namespace(), TOKENS)
    for params in (None, {}, {"ucm_load_mode": "sync"}, {"do_remote_prefill": False, "ucm_blocks": ["x"]}):
        assert named_blocks(params, keys, "r") == 0


# ---- the prefill side ---------------------------------------------------------------
def test_the_prefill_side_returns_the_blocks_it_saved():
    side, _ = _side(can_load=False)
    req = _request("p1", params={"do_remote_decode": True, "do_remote_prefill": False})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(p) for p in range(6)],)), 0)
    meta = _prefill_step(side, "p1", range(6))
    keys = block_keys(_namespace(), TOKENS)
    assert [j.keys for j in meta.stores] == [keys]
    delay, params = _finish(side, req)
    assert delay is True  # its pages stay until the saves are done
    assert params == producer_params(keys, BLOCK)


def test_a_plain_request_or_an_aborted_prefill_returns_no_params():
    side, _ = _side()
    plain = _request("a")
    side.get_num_new_matched_tokens(plain, 0)
    assert _finish(side, plain)[1] is None
    aborted = _request("b", params={"do_remote_decode": True})
    side.get_num_new_matched_tokens(aborted, 0)
    assert _finish(side, aborted, RequestStatus.FINISHED_ABORTED)[1] is None


def test_a_consumer_only_engine_returns_no_params():
    side, _ = _side(can_save=False)
    req = _request("p", params={"do_remote_decode": True})
    side.get_num_new_matched_tokens(req, 0)
    assert _finish(side, req)[1] is None


# ---- the decode side ----------------------------------------------------------------
def _named(tokens=TOKENS):
    return producer_params(block_keys(_namespace(), tokens), BLOCK)


def test_the_decode_side_claims_blocks_not_committed_yet_as_a_waiting_async_load():
    side, cache = _side(pd_wait_s=3.0)
    req = _request("d1", params=_named())
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)  # vLLM asks again: the same answer
    side.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(p) for p in range(6)],)), 2 * BLOCK)
    meta = side.build_connector_meta(SchedulerOutput.make_empty())
    [job] = meta.loads
    assert job.is_async and job.wait_s == 3.0 and job.keys == block_keys(_namespace(), TOKENS)
    assert job.page_ids == [[0, 1], [2, 3]]
    assert side.pd_requests == 1


def test_the_decode_side_computes_only_the_last_partial_block_and_one_token_of_a_whole_prompt():
    side, _ = _side()
    whole = TOKENS[:2 * BLOCK]
    assert side.get_num_new_matched_tokens(_request("w", whole, _named(whole)), 0) == (2 * BLOCK - 1, True)
    assert side.get_num_new_matched_tokens(_request("v", TOKENS, _named()), BLOCK) == (BLOCK, True)
    # vLLM's own cache holds every named block: nothing to load, and never an empty asynchronous load
    assert side.get_num_new_matched_tokens(_request("u", TOKENS, _named()), 2 * BLOCK) == (0, False)


def test_committed_blocks_load_as_any_hit_without_waiting():
    side, cache = _side()
    for k in block_keys(_namespace(), TOKENS):
        cache.tiers[k] = "dram"
    req = _request("d", params=_named())
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, False)  # in DRAM: synchronous
    side.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(p) for p in range(6)],)), 2 * BLOCK)
    [job] = side.build_connector_meta(SchedulerOutput.make_empty()).loads
    assert not job.is_async and job.wait_s == 0.0


def test_unusable_params_make_a_plain_request():
    side, cache = _side()
    keys = block_keys(_namespace(), TOKENS)
    cache.tiers[keys[0]] = "dram"
    req = _request("d", params={"do_remote_prefill": True, "ucm_blocks": "not a list"})
    with pytest.warns(TransferParamsWarning):
        assert side.get_num_new_matched_tokens(req, 0) == (BLOCK, False)  # what its own cache holds
    assert side.pd_requests == 0


def test_a_load_that_lost_named_blocks_ends_the_claim():
    side, cache = _side()
    req = _request("d", params=_named())
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, KVCacheBlocks(blocks=([KVCacheBlock(p) for p in range(6)],)), 2 * BLOCK)
    side.build_connector_meta(SchedulerOutput.make_empty())
    side.update_connector_output(KVConnectorOutput(invalid_block_ids={2, 3}))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # computed here now: never waited for again


def test_a_producer_only_engine_ignores_named_blocks():
    side, _ = _side(can_load=False)
    assert side.get_num_new_matched_tokens(_request("d", params=_named()), 0) == (0, False)


def test_the_wait_is_a_per_request_setting_with_a_typed_error():
    s = ConnectorSettings()
    assert s.for_request({"ucm_pd_wait_s": 0.5}).pd_wait_s == 0.5
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.ucm_pd_wait_s must be a number >= 0"):
        s.for_request({"ucm_pd_wait_s": -1})


# ---- the workers ----------------------------------------------------------------------
B, L, PPB = 10, 2, 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def _worker(cache, **settings):
    w = UCMWorkerSide(cache, pages_per_block=PPB, num_kv_blocks=B, settings=ConnectorSettings(**settings))
    kv = {n: torch.randn(B, 2, 16, 64).to(torch.bfloat16) for n in NAMES}
    w.register_kv_caches(kv)
    return w, kv


def _done(w, *req_ids):
    """Whether every one of `req_ids` is reported done receiving in time."""
    seen, deadline = set(), time.monotonic() + JOIN_S
    while time.monotonic() < deadline:
        seen |= w.get_finished(set())[1] or set()
        if seen >= set(req_ids):
            return True
        time.sleep(0.01)
    return False


def test_the_decode_worker_waits_for_the_prefill_workers_save_then_copies_its_bytes():
    cache = FakeCache()
    prefill, pkv = _worker(cache)
    decode, dkv = _worker(cache)
    a = b"A" * 16
    decode.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("d", [a], [[5, 6]], True, wait_s=JOIN_S)]))
    time.sleep(0.05)
    assert decode.get_finished(set()) == (None, None)  # still waiting: nothing was committed
    prefill.wait_for_save(UCMConnectorMetadata(stores=[StoreJob("p", [a], [[1, 2]], None)]))
    assert _done(decode, "d")
    assert decode.get_block_ids_with_load_errors() == set()
    for n in NAMES:
        assert torch.equal(dkv[n][5:7], pkv[n][1:3])
    prefill.shutdown()
    decode.shutdown()


def test_blocks_that_never_come_are_load_errors_after_the_wait():
    cache = FakeCache()
    decode, dkv = _worker(cache)
    before = {n: dkv[n].clone() for n in NAMES}
    decode.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("d", [b"A" * 16, b"B" * 16], [[3, 4], [5, 6]], True,
                                                             wait_s=0.1)]))
    assert _done(decode, "d")
    assert decode.get_block_ids_with_load_errors() == {3, 4, 5, 6}  # vLLM recomputes them
    assert decode.counters["pd_late_blocks"] == 2
    for n in NAMES:
        assert torch.equal(dkv[n], before[n])
    decode.shutdown()


class _ServiceGone(FakeCache):
    """A service's client whose service died: no link, and none to be had."""

    connected = False

    def __init__(self):
        super().__init__()
        self.connects = 0

    def try_connect(self):
        self.connects += 1
        return False


def test_with_the_service_gone_the_decode_worker_stops_waiting_and_reports_the_blocks_as_errors():
    cache = _ServiceGone()
    decode, _ = _worker(cache)
    decode.start_load_kv(UCMConnectorMetadata(loads=[LoadJob("d", [b"A" * 16], [[3, 4]], True,
                                                             wait_s=100 * JOIN_S)]))
    assert _done(decode, "d")  # within JOIN_S: not after the request's wait of 100 x JOIN_S
    assert decode.get_block_ids_with_load_errors() == {3, 4}  # vLLM computes them at once
    assert cache.connects >= 1 and decode.counters["pd_late_blocks"] == 1
    decode.shutdown()


def test_a_waiting_decode_load_does_not_hold_up_the_engines_own_saves():
    cache = FakeCache()
    w, kv = _worker(cache)
    w.start_load_kv(UCMConnectorMetadata(loads=[LoadJob(f"d{i}", [bytes([i]) * 16], [[i, i + 1]], True,
                                                        wait_s=JOIN_S) for i in range(3)]))
    saved = threading.Event()
    w.wait_for_save(UCMConnectorMetadata(stores=[StoreJob("s", [b"S" * 16], [[8, 9]], None)]))
    deadline = time.monotonic() + JOIN_S
    while time.monotonic() < deadline and not saved.is_set():
        if b"S" * 16 in cache.slots:
            saved.set()
        time.sleep(0.01)
    assert saved.is_set(), "a save waited behind decode loads waiting for another engine"
    for i in range(3):  # the other engine commits them: the loads end
        cache.tiers[bytes([i]) * 16] = "dram"
        cache.slots[bytes([i]) * 16] = cache.slots[b"S" * 16]
    assert _done(w, "d0", "d1", "d2")
    w.shutdown()
