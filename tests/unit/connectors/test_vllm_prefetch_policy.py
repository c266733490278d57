"""The scheduler's prefetch policies (`ucm_prefetch_policy`): a hit below
DRAM is staged first while the request waits without pages (vLLM asks
again next step), then loaded synchronously from DRAM; a staging that
comes back short loads the rest as without a policy, a late one is a
shorter hit, never a stall, and after two late ones the request goes
without ucm. Same fakes and geometry as
test_vllm_scheduler.py (256-token blocks of two 128-token pages)."""
import pytest

pytest.importorskip("vllm")
from test_vllm_scheduler import _blocks, _cache, _output, _request, _side  # noqa: E402

TOKENS = list(range(3 * 256 + 10))  # three full blocks and a partial one


def test_off_keeps_the_asynchronous_load_and_stages_nothing():
    side, cache = _side(load_streaming="off")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    assert side.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (768, True)
    assert cache.prefetches == []


def test_wait_complete_waits_without_pages_then_loads_everything_from_dram():
    side, cache = _side(prefetch_policy="wait_complete")
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert cache.prefetches[0][0] == keys[1:3]  # only the blocks below DRAM
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # still staging: ask again
    assert len(cache.prefetches) == 1  # issued once
    cache.stage(0)
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)  # a synchronous DRAM load
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6, 7]), 768)
    [job] = side.build_connector_meta(_output()).loads
    assert not job.is_async and job.page_ids == [[1, 2], [3, 4], [5, 6]]


def test_a_staging_that_comes_back_short_loads_the_rest_as_without_a_policy():
    """Not a loss (issue #16, ucm bench prefetch): the hit used to stop at
    block 1 and the rest was recomputed; it now loads in the background."""
    side, cache = _side(prefetch_policy="wait_complete")
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    cache.stage(0, refuse={keys[1]})  # block 1 found no room in DRAM; block 2 did
    assert side.get_num_new_matched_tokens(req, 0) == (768, True)  # block 1 from NVMe, asynchronously
    assert side._reqs["r"].staging_losses == 0
    stats = side.staging_stats()
    assert (stats["stagings"], stats["blocks_staged"], stats["short"], stats["late"]) == (1, 2, 1, 0)
    assert stats["wait_s"] >= 0


def test_timeout_answers_with_what_is_in_dram_when_the_staging_is_late():
    side, cache = _side(prefetch_policy="timeout", prefetch_timeout_s=0, prefetch_timeout_per_1k_tokens_s=0)
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.get_num_new_matched_tokens(req, 0) == (256, False)  # late: block 0 only, synchronously
    cache.stage(0)  # it goes on and serves the next request over the same prompt
    assert cache.tiers[keys[2]] == "dram"
    assert side.get_num_new_matched_tokens(_request("r2", TOKENS), 0) == (768, False)


def test_the_timeout_grows_with_the_hit():
    side, cache = _side(prefetch_policy="timeout", prefetch_timeout_s=0.25, prefetch_timeout_per_1k_tokens_s=1.0)
    _cache(cache, TOKENS, ["nvme", "nvme", "nvme"])
    import time
    t0 = time.monotonic()
    assert side.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (None, False)
    wait = side._reqs["r"].staging_deadline - t0
    assert 0.25 + 0.768 - 0.05 < wait < 0.25 + 0.768 + 0.05  # 768 hit tokens


def test_best_effort_answers_at_once_and_stages_for_later_requests():
    side, cache = _side(prefetch_policy="best_effort")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (256, False)
    assert side.get_num_new_matched_tokens(req, 0) == (256, False)
    assert len(cache.prefetches) == 1
    cache.stage(0)
    assert side.get_num_new_matched_tokens(_request("r2", TOKENS), 0) == (768, False)


def test_blocks_vllm_holds_are_not_staged():
    side, cache = _side(prefetch_policy="wait_complete")
    _cache(cache, TOKENS, ["nvme", "dram", "dram"])
    assert side.get_num_new_matched_tokens(_request("r", TOKENS), 256) == (512, False)
    assert cache.prefetches == []


def test_a_prefetch_fault_is_a_shorter_hit_never_an_exception():
    side, cache = _side(prefetch_policy="wait_complete")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    cache.broken.add("prefetch")
    assert side.get_num_new_matched_tokens(_request("r", TOKENS), 0) == (256, False)


def test_two_lost_stagings_and_the_request_goes_without_ucm():
    side, cache = _side(prefetch_policy="timeout", prefetch_timeout_s=0, prefetch_timeout_per_1k_tokens_s=0)
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.get_num_new_matched_tokens(req, 0) == (256, False)  # lost once
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6, 7]), 256)
    side.build_connector_meta(_output(new=[("r", [1, 2, 3, 4, 5, 6, 7], 256, 32)]))
    side.build_connector_meta(_output(preempted={"r"}))  # resumed later: a fresh lookup, a fresh staging
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # lost twice: computed without ucm
    assert len(cache.prefetches) == 2
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # and stays so, without staging again
    assert len(cache.prefetches) == 2
    assert side.staging_stats()["late"] == 2 and side.staging_stats()["gave_up"] == 1


@pytest.mark.parametrize("extra, match", [
    ({"ucm_prefetch_policy": "eager"}, r"ucm_prefetch_policy: 'eager' not one of \['off', 'best_effort'"),
    ({"ucm_prefetch_timeout_s": -1}, r"ucm_prefetch_timeout_s must be a number >= 0"),
])
def test_bad_prefetch_settings_name_the_key(extra, match):
    from ucm.connectors.vllm.settings import ConnectorSettings
    from ucm.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.from_extra(extra)


def test_a_new_request_is_begun_and_staged_on_arrival_while_it_queues():
    side, cache = _side(prefetch_policy="wait_complete")
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    side.on_new_request(req)  # vLLM added it; it may wait behind others
    assert cache.events == [("begin", "r", 3)] and cache.prefetches[0][0] == keys[1:3]
    cache.stage(0)  # staged while it queued
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)  # no wait left when it is scheduled
    assert cache.events == [("begin", "r", 3)] and len(cache.prefetches) == 1  # begun and staged once


def test_without_a_policy_arrival_only_begins_the_request():
    side, cache = _side(load_streaming="off")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    side.on_new_request(req)
    assert cache.events == [("begin", "r", 3)] and cache.prefetches == [] and cache.pinned() == 0
    assert side.get_num_new_matched_tokens(req, 0) == (768, True)
    assert cache.events == [("begin", "r", 3)]


def test_a_cache_fault_on_arrival_never_reaches_vllm():
    side, cache = _side(prefetch_policy="wait_complete")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    cache.broken.update({"begin_request", "lookup", "prefetch"})
    req = _request("r", TOKENS)
    side.on_new_request(req)
    cache.broken.clear()
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # the lookup at arrival was a miss


def test_best_effort_loads_what_a_staging_begun_on_arrival_brought_to_dram():
    """Review of ucm bench prefetch: best_effort kept the tiers it saw on
    arrival (all NVMe), so a request staged while it queued was computed
    cold anyway."""
    side, cache = _side(prefetch_policy="best_effort")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _request("r", TOKENS)
    side.on_new_request(req)
    cache.stage(0)  # done while it queued
    assert side.get_num_new_matched_tokens(req, 0) == (768, False)
    assert side.staging_stats()["short"] == 0 and side.staging_stats()["late"] == 0


def test_stagings_stay_within_the_budget_and_a_request_beyond_it_loads_without_waiting():
    """Staged-but-unloaded blocks are bounded (half of DRAM by default): a
    request whose staging would pass the bound is not staged (counted) and
    loads its hit as without a policy (here streamed under the forward),
    instead of evicting another waiting request's staged blocks."""
    side, cache = _side(prefetch_policy="wait_complete", load_streaming="auto")
    side.stagings.budget.max_blocks = 3
    other = [t + 100_000 for t in TOKENS]
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    _cache(cache, other, ["nvme", "nvme", "nvme"])
    a, b = _request("a", TOKENS), _request("b", other)
    assert side.get_num_new_matched_tokens(a, 0) == (None, False)  # 2 blocks staged: within 3
    assert side.get_num_new_matched_tokens(b, 0) == (768, False)  # 3 more would pass it: streamed at once
    assert len(cache.prefetches) == 1 and side.staging_stats()["over_budget"] == 1
    assert side.stagings.budget.used == 2
    side.update_state_after_alloc(b, _blocks([11, 12, 13, 14, 15, 16, 17]), 768)
    [job] = side.build_connector_meta(_output()).loads
    assert job.stream and not job.is_async
    cache.stage(0)
    assert side.get_num_new_matched_tokens(a, 0) == (768, False)
    side.update_state_after_alloc(a, _blocks([1, 2, 3, 4, 5, 6, 7]), 768)
    assert side.stagings.budget.used == 0  # a's load is planned: its share is given back


def _asking(req_id, tokens, **params):
    """A request whose kv_transfer_params carry `params` (as SamplingParams.extra_args
    or the OpenAI server's kv_transfer_params field give them to vLLM)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, list(tokens), SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": params}),
                   None)


def test_a_request_sets_its_own_prefetch_policy_and_streaming():
    """kv_transfer_params override the engine's policy for that request
    only: one engine serves a latency-bound request and a waiting one."""
    side, cache = _side(load_streaming="off")  # the engine: no policy, asynchronous loads
    keys = _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    waiting = _asking("w", TOKENS, ucm_prefetch_policy="wait_complete", do_remote_prefill=False)
    assert side.get_num_new_matched_tokens(waiting, 0) == (None, False)  # it stages and waits
    assert cache.prefetches[0][0] == keys[1:3]
    plain = _request("p", TOKENS)
    assert side.get_num_new_matched_tokens(plain, 0) == (768, True)  # the engine's way: no staging
    streamed = _asking("s", TOKENS, ucm_load_streaming="auto")
    assert side.get_num_new_matched_tokens(streamed, 0) == (768, False)  # loaded under the forward
    assert side._reqs["s"].load_stream and not side._reqs["p"].load_stream
    assert len(cache.prefetches) == 1 and side.bad_request_settings == 0


def test_a_request_can_turn_the_engines_policy_off():
    side, cache = _side(prefetch_policy="wait_complete")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    req = _asking("r", TOKENS, ucm_prefetch_policy="off", ucm_load_streaming="off")
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (768, True)
    assert cache.prefetches == []


@pytest.mark.parametrize("params, match", [
    ({"ucm_prefetch_policy": "eager"}, r"kv_transfer_params\.ucm_prefetch_policy: 'eager' not one of"),
    ({"ucm_prefetch_timeout_s": "1s"}, r"kv_transfer_params\.ucm_prefetch_timeout_s must be a number >= 0"),
    ({"ucm_model_id": "other"}, r"'ucm_model_id' cannot be set per request; allowed: \['ucm_load_mode'"),
])
def test_a_bad_request_override_is_logged_and_the_engines_settings_apply(params, match, caplog):
    from ucm.connectors.vllm.settings import ConnectorSettings
    from ucm.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        ConnectorSettings().for_request(params)
    side, cache = _side(load_streaming="off")
    _cache(cache, TOKENS, ["dram", "nvme", "nvme"])
    with caplog.at_level("WARNING", logger="ucm.connectors.vllm.scheduler"):
        assert side.get_num_new_matched_tokens(_asking("r", TOKENS, **params), 0) == (768, True)
    assert side.bad_request_settings == 1 and cache.prefetches == []
    assert any(next(iter(params)) in r.getMessage() for r in caplog.records)


def test_keys_of_other_connectors_are_left_alone():
    from ucm.connectors.vllm.settings import ConnectorSettings

    base = ConnectorSettings(prefetch_policy="timeout")
    assert base.for_request({"do_remote_prefill": True, "remote_host": "x"}) is base
    assert base.for_request(None) is base
    got = base.for_request({"ucm_prefetch_timeout_s": 2, "ucm_load_mode": "async"})
    assert (got.prefetch_timeout_s, got.load_mode, got.prefetch_policy) == (2, "async", "timeout")
    # a prefill engine's blocks and a blend's chunk spans ride along with an override: neither is refused
    got = base.for_request({"ucm_blocks": ["00"], "ucm_chunks": [[0, 4]], "ucm_pd_wait_s": 0.5})
    assert got.pd_wait_s == 0.5 and got.prefetch_policy == "timeout"


class _Staged:
    def done(self):
        return False


def test_the_policy_alone_queues_arrivals_over_the_budget_and_admits_them_as_it_frees():
    """PrefetchPolicy without a scheduler side: a prefetch function in, a
    step out; the second arrival waits in the queue, not for room."""
    from ucm.connectors.vllm.prefetch_policy import PrefetchPolicy, StagingStep
    from ucm.connectors.vllm.request_state import ReqState
    from ucm.connectors.vllm.settings import ConnectorSettings

    issued = []
    policy = PrefetchPolicy(lambda keys: issued.append(keys) or _Staged(), landing_tier="dram",
                            block_tokens=256, max_staging_blocks=3)
    settings = ConnectorSettings(prefetch_policy="wait_complete")
    a, b = (ReqState(keys=[bytes([i, j]) for j in range(3)], settings=settings, hit_blocks=3,
                     hit_tiers=["dram", "nvme", "nvme"]) for i in range(2))
    assert policy.stage(a, 0, arrival=True) is StagingStep.WAIT
    assert policy.stage(b, 0, arrival=True) is StagingStep.GO  # 2 + 2 blocks pass 3: queued
    assert issued == [a.keys[1:]] and policy.budget.used == 2
    policy.leave(a)  # a loads now: b's staging is issued
    assert issued == [a.keys[1:], b.keys[1:]] and policy.budget.used == 2
    assert policy.stats()["stagings"] == 2 and policy.stats()["over_budget"] == 0
