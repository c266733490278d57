"""Blended requests on UCMConnector's scheduler side
(ucm/connectors/vllm/blend_request.py, scheduler.py) and the key rotation
of its worker side (ucm/connectors/vllm/blend.py): spans and ratios read
from `kv_transfer_params` (bad ones are a typed warning and a plain
request), the claim of the blended part as a synchronous load, the job
the worker gets, no block of a blended request saved, a failed blend
computed by vLLM as a plain request, the chunk entries' namespace, and
keys moved by vLLM's own rotary embedding.

UCMSchedulerSide runs with vLLM's real Request and SchedulerOutput over a
FakeCache. Geometry: pages of 128 tokens, blocks of 256."""
import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from connector_fakes import FakeCache  # noqa: E402
from ucm.connectors.vllm.blend_request import (  # noqa: E402
    BlendPlanner,
    chunk_keys,
    chunk_namespace,
    chunk_spans,
    request_options,
)
from ucm.connectors.vllm.metadata import BlendJob  # noqa: E402
from ucm.connectors.vllm.scheduler import UCMSchedulerSide  # noqa: E402
from ucm.errors import TransferParamsWarning  # noqa: E402
from ucm.keys import Namespace, block_keys  # noqa: E402

PAGE, BLOCK = 128, 256
SYSTEM = list(range(5000, 5128))  # 128 tokens
P1, P2 = list(range(6000, 6256)), list(range(7000, 7300))  # a passage of one block, one of a block and 44 tokens
QUESTION = list(range(8000, 8020))
TOKENS = SYSTEM + P1 + P2 + QUESTION  # 704 tokens
SPANS = [[128, 384], [384, 684]]


def _namespace():
    return Namespace(model="test-model", kv_dtype="float32", num_layers=2, num_kv_heads=2, head_size=16,
                     block_tokens=BLOCK, layout=f"vllm-cpu-page{PAGE}")


def _side(cache=None, **planner):
    cache = cache if cache is not None else FakeCache()
    side = UCMSchedulerSide(cache, _namespace(), page_tokens=PAGE, landing_tier="dram", max_waiting_pin_blocks=16)
    side.blends = BlendPlanner(_namespace(), **planner)
    return side, cache


def _request(req_id, params=None, salt=None, tokens=TOKENS):
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8, extra_args=extra), None, cache_salt=salt)


def _step(side, req_id, pages, computed=0):
    return side.build_connector_meta(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=req_id, prompt_token_ids=None, mm_features=[], sampling_params=None,
                                           pooling_params=None, block_ids=(list(pages),), num_computed_tokens=computed,
                                           lora_request=None)],
        scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens={req_id: len(TOKENS) - computed},
        total_num_scheduled_tokens=len(TOKENS) - computed, scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0], finished_req_ids=set(), free_encoder_mm_hashes=[]))


def _blocks(n=6):
    return KVCacheBlocks(blocks=([KVCacheBlock(p) for p in range(10, 10 + n)],))


# ---- the params ---------------------------------------------------------------------
def test_spans_in_order_within_the_prompt_are_read():
    assert chunk_spans({"ucm_chunks": SPANS}, len(TOKENS), "r") == [(128, 384), (384, 684)]
    assert chunk_spans({"ucm_chunks": [(0, len(TOKENS))]}, len(TOKENS), "r") == [(0, len(TOKENS))]
    assert chunk_spans(None, len(TOKENS), "r") == [] and chunk_spans({"other": 1}, len(TOKENS), "r") == []


@pytest.mark.parametrize("bad", [
    "0-10", [], [[0]], [[10, 10]], [[0, 10], [5, 20]], [[20, 30], [0, 10]], [[0, len(TOKENS) + 1]], [[-1, 5]],
    [[0, True]], [[0.0, 5]]])
def test_malformed_spans_are_a_typed_warning_and_no_blend(bad):
    with pytest.warns(TransferParamsWarning, match="ucm_chunks"):
        assert chunk_spans({"ucm_chunks": bad}, len(TOKENS), "r") == []


def test_a_requests_own_blend_options_are_read_and_bad_ones_warned():
    assert request_options({"ucm_blend": {"ratio": 0.3}}, "r") == {"ratio": 0.3}
    assert request_options({"ucm_blend": {"select": "leading", "leading_tokens": 8}}, "r")["select"] == "leading"
    assert request_options({"ucm_blend": {"select": "question", "ratio": 0.1}}, "r") == {"select": "question",
                                                                                          "ratio": 0.1}
    assert request_options({}, "r") == {} and request_options(None, "r") == {}
    for bad, names in (({"ratio": 1.5}, "ratio"), ({"select": "all"}, "select"), ({"ratoi": 0.2}, "ratoi"),
                       ({"context": "none"}, "context"), ([0.2], "mapping")):
        with pytest.warns(TransferParamsWarning, match=f"ucm_blend.*{names}"):
            assert request_options({"ucm_blend": bad}, "r") == {}


# ---- the scheduler side -------------------------------------------------------------
def test_the_blended_part_is_claimed_synchronously_and_shipped_as_one_job():
    side, cache = _side()
    req = _request("r", {"ucm_chunks": SPANS, "ucm_blend": {"ratio": 0.25}})
    assert side.get_num_new_matched_tokens(req, 0) == (684, False)  # up to the last chunk's end
    assert side.get_num_new_matched_tokens(req, 0) == (684, False)  # asked again: the same answer
    side.update_state_after_alloc(req, _blocks(), 684)
    meta = _step(side, "r", range(10, 16), computed=684)
    assert not meta.loads and not meta.stores  # nothing loaded as exact blocks; nothing saved
    (job,) = meta.blends
    assert isinstance(job, BlendJob) and job.tokens == TOKENS[:684] and job.spans == [(128, 384), (384, 684)]
    assert job.start == 0 and job.options == {"ratio": 0.25} and job.block_tokens == BLOCK and job.page_ids == list(range(10, 16))
    assert job.question == TOKENS[684:]  # what the `question` selection weighs by; vLLM computes it
    ns = chunk_namespace(_namespace(), SYSTEM, "", None)
    assert job.keys == [block_keys(ns, P1), block_keys(ns, P2[:256])]  # whole blocks of each passage
    assert job.blended_pages(PAGE) == list(range(10, 16))  # pages 0..5 hold tokens 0..683
    assert side.blends.counts["blended"] == 1


def test_a_blended_request_saves_nothing_and_a_plain_one_beside_it_does():
    side, _ = _side()
    blended, plain = _request("b", {"ucm_chunks": SPANS}), _request("p")
    side.get_num_new_matched_tokens(blended, 0)
    side.update_state_after_alloc(blended, _blocks(), 684)
    assert _step(side, "b", range(10, 16), computed=684).stores == []
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False)
    side.update_state_after_alloc(plain, _blocks(), 0)
    (store,) = _step(side, "p", range(10, 16)).stores
    assert store.keys == block_keys(_namespace(), TOKENS)


@pytest.mark.parametrize("planner, salt, computed, why", [
    ({"why_not": "no model"}, None, 0, "no model"),
    ({"prefix_caching": True}, None, 0, "no cache_salt"),
    ({}, None, 256, "past the system prompt"),
])
def test_a_request_the_engine_cannot_blend_is_a_plain_request(planner, salt, computed, why, caplog):
    side, cache = _side(**planner)
    req = _request("r", {"ucm_chunks": SPANS}, salt=salt)
    with caplog.at_level("INFO", logger="ucm.connectors.vllm.blend_request"):
        assert side.get_num_new_matched_tokens(req, computed) == (0, False)  # the cache holds nothing: a miss
    assert any(why in r.getMessage() for r in caplog.records)
    side.update_state_after_alloc(req, _blocks(), 0)
    meta = _step(side, "r", range(10, 16), computed=computed)
    assert meta.blends == [] and meta.stores  # computed as a plain request, and saved as one
    assert side.blends.counts["declined"] == 1


def test_with_vllms_prefix_cache_a_salted_request_is_blended():
    side, _ = _side(prefix_caching=True)
    assert side.get_num_new_matched_tokens(_request("r", {"ucm_chunks": SPANS}, salt="tenant"), 0) == (684, False)


def test_a_failed_blend_is_recomputed_as_a_plain_request_and_saved():
    side, cache = _side()
    req = _request("r", {"ucm_chunks": SPANS})
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, _blocks(), 684)
    (job,) = _step(side, "r", range(10, 16), computed=684).blends
    side.update_connector_output(KVConnectorOutput(invalid_block_ids=set(job.blended_pages(PAGE))))
    assert side.blends.counts["failed"] == 1
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # vLLM computes it
    side.update_state_after_alloc(req, _blocks(), 0)
    meta = _step(side, "r", range(10, 16))
    assert meta.blends == [] and meta.stores[0].keys == block_keys(_namespace(), TOKENS)


# ---- the chunks' entries ---------------------------------------------------------------
def test_a_chunks_keys_name_its_tokens_the_system_prompt_the_rope_and_the_salt():
    base = _namespace()
    ns = chunk_namespace(base, SYSTEM, "rope-a", None)
    first = chunk_keys(ns, TOKENS, [(128, 384)], 684)
    later = chunk_keys(ns, SYSTEM + P2 + P1, [(428, 684)], 684)  # the same passage further on
    assert first == later and first[0] == block_keys(ns, P1)
    others = [chunk_namespace(base, SYSTEM[:-1] + [1], "rope-a", None), chunk_namespace(base, SYSTEM, "rope-b", None),
              chunk_namespace(base, SYSTEM, "rope-a", "tenant"), base]
    assert all(block_keys(o, P1) != first[0] for o in others)
    assert chunk_keys(ns, TOKENS, [(128, 300)], 684) == [[]]  # shorter than a block: no entry


# ---- moving keys with vLLM's rotary embedding ------------------------------------------
@pytest.mark.parametrize("neox", [True, False])
def test_keys_computed_at_p_and_moved_by_d_are_the_keys_computed_at_p_plus_d(neox):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from ucm.connectors.vllm.blend import rotate_keys

    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(64, 8192, is_neox_style=neox, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 100000.0},
                          dtype=torch.float32)
    raw = torch.randn(40, 3 * 64, generator=torch.Generator().manual_seed(0))

    def at(p):
        _, k = rotary(torch.arange(p, p + 40), torch.zeros(40, 64), raw.clone())
        return k.view(40, 3, 64)

    a, b = at(100), at(3100)
    moved = rotate_keys(rotary, a, 3000)
    # float32 angles of positions near 3,100 carry ~2e-4 rad of rounding in vLLM's own cos/sin cache
    assert torch.allclose(moved, b, atol=1e-3) and not torch.allclose(a, b, atol=1.0)
    assert torch.equal(rotate_keys(rotary, a, 0), a)
    assert torch.allclose(rotate_keys(rotary, rotate_keys(rotary, a, 1000), 2000), b, atol=1e-3)


# ---- the worker side's glue ----------------------------------------------------------------
@pytest.mark.parametrize("blender", ["raises", None])
def test_a_blend_that_fails_in_the_worker_becomes_load_errors_never_an_exception(blender):
    from types import SimpleNamespace

    from ucm.connectors.vllm import UCMConnector
    from ucm.connectors.vllm.metadata import UCMConnectorMetadata

    class Broken:
        def blend(self, job):
            raise RuntimeError("injected")

    errors = []
    conn = UCMConnector.__new__(UCMConnector)  # the glue only: no engine behind it
    conn._worker = SimpleNamespace(start_load_kv=lambda meta: None, add_load_errors=errors.extend)
    conn._vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=PAGE))
    conn.blender, conn.blend_unsupported = (Broken() if blender else None), ""
    job = BlendJob("r", TOKENS[:684], [(128, 384)], [[]], BLOCK, list(range(10, 16)), start=128)
    conn._connector_metadata = UCMConnectorMetadata(blends=[job])
    conn.start_load_kv(None)
    assert errors == list(range(11, 16))  # the pages from vLLM's own hit (page 10) to the blended end


def test_the_engines_blend_options_come_from_its_config_and_vllm_refuses_passages_computed_alone(tmp_path):
    from ucm.config.schema import load_config
    from ucm.connectors.vllm.blend_request import engine_options
    from ucm.errors import ConfigError

    def config(accelerators):
        return load_config({"tiers": [{"adapter": "dram", "capacity": "64MiB"}], "accelerators": accelerators})

    assert engine_options(config([])).ratio == 0.15  # the defaults
    assert engine_options(config([{"name": "blend", "options": {"ratio": 0.3}}])).ratio == 0.3
    with pytest.raises(ConfigError, match=r"accelerators\.0\.options\.context: 'none'.*allowed: \['prefix'\]"):
        engine_options(config([{"name": "blend", "options": {"context": "none"}}]))
    assert engine_options(config([{"name": "blend", "options": {"select": "question"}}])).select == "question"


# ---- a separator string instead of spans (LMCache's convention) --------------------------------
def test_the_parts_between_separators_are_the_passages():
    from ucm.connectors.vllm.blend_request import separated_spans

    sep = [9, 9, 8]
    tokens = [1, 2, 3] + sep + [4, 5] + sep + [6, 7, 7] + sep + [1, 1]  # system, p1, p2, question
    assert separated_spans(tokens, sep) == [(6, 8), (11, 14)]
    assert separated_spans([1] + sep + [2], sep) == []  # one separator: no passage between two
    assert separated_spans(sep + sep + [5] + sep, sep) == [(6, 7)]  # an empty part is no passage
    assert separated_spans([9, 9, 9, 8, 4] + sep, sep) == [(4, 5)]  # a near match is not a separator
    assert separated_spans(tokens, []) == []


def test_an_engine_with_a_separator_blends_prompts_that_hold_it_and_spans_still_win():
    sep = [3, 3]
    tokens = SYSTEM + sep + P1 + sep + P2 + sep + QUESTION
    side, _ = _side(separator=sep)
    claimed, is_async = side.get_num_new_matched_tokens(_request("r", tokens=tokens), 0)
    assert not is_async and claimed == 128 + 2 + 256 + 2 + 300  # up to the last passage's end
    side.update_state_after_alloc(_request("r", tokens=tokens), _blocks(7), claimed)
    (job,) = _step(side, "r", range(10, 17), computed=claimed).blends
    assert job.spans == [(130, 386), (388, 688)]
    assert side.get_num_new_matched_tokens(_request("s", {"ucm_chunks": SPANS}, tokens=tokens), 0) == (684, False)
    assert side.get_num_new_matched_tokens(_request("plain"), 0) == (0, False)  # no separator in it


def test_a_blank_separator_is_a_config_error():
    from ucm.connectors.vllm.settings import ConnectorSettings
    from ucm.errors import ConfigError

    assert ConnectorSettings.from_extra({"ucm_blend_separator": " # # "}).blend_separator == " # # "
    with pytest.raises(ConfigError, match="ucm_blend_separator"):
        ConnectorSettings.from_extra({"ucm_blend_separator": "  "})
