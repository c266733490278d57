"""Sparse attention as an accelerator (ucm/accelerators/sparse/accelerator.py):
enabled in the YAML file through its entry point, built in an engine
process's chain (not the cache's), reached by type, and carrying every
setting sparse decode reads."""
import numpy as np
import pytest

import ucm.accelerators.base as base
from ucm.accelerators.chain import Accelerators
from ucm.accelerators.prefetch import Prefetch, PrefetchAccelerator
from ucm.accelerators.sparse.accelerator import SparseAccelerator
from ucm.accelerators.sparse.base import Budget, LayerStep, SelectionConfig
from ucm.accelerators.sparse.index import SummaryIndex
from ucm.accelerators.sparse.selectors import HybridSelector, QuestSelector, SinkLocalSelector
from ucm.accelerators.sparse.summaries import SummaryParts
from ucm.cache.unified import UnifiedCache
from ucm.config.schema import load_config
from ucm.errors import ArgumentError, ConfigError


def conf(tmp_path, accelerators, block_tokens=256):
    return {"block_tokens": block_tokens, "tiers": [{"adapter": "dram", "capacity": "1MiB",
                                                     "options": {"path": str(tmp_path)}}],
            "policy": {"name": "lru"}, "accelerators": accelerators}


def sparse(tmp_path, block_tokens=256, **options):
    cfg = load_config(conf(tmp_path, [{"name": "sparse", "options": options}], block_tokens), environ={})
    return cfg, Accelerators.build(cfg, cache=None, runs_in="engine").get(SparseAccelerator)


def test_sparse_and_prefetch_are_installed_under_their_role_names():
    assert {"prefetch", "sparse"} <= set(base.accelerator_names())
    assert base.load_accelerator_class("sparse") is SparseAccelerator
    assert base.load_accelerator_class("prefetch") is PrefetchAccelerator
    assert Prefetch is PrefetchAccelerator  # the older name still imports
    assert (SparseAccelerator.runs_in, PrefetchAccelerator.runs_in) == ("engine", "cache")


def test_the_yaml_options_reach_the_accelerator(tmp_path):
    _, acc = sparse(tmp_path, selector="quest", budget={"ratio": 0.25}, sink_tokens=64, local_tokens=128,
                    page_tokens=32, summary_capacity_bytes="64MiB")
    assert acc.selection == SelectionConfig(Budget.ratio(0.25), 64, 128)
    assert isinstance(acc.make_selector(), QuestSelector)
    assert acc.make_selector() is not acc.make_selector()  # one per caller (`random` keeps state)
    assert acc.summary_parts() == SummaryParts(bounds=True, mean=False)
    index = acc.new_index()
    assert isinstance(index, SummaryIndex)
    assert (index.capacity_bytes, index.page_tokens) == (64 << 20, 32)


def test_the_defaults_are_the_hybrid_selector_and_a_budget_of_1024_tokens(tmp_path):
    _, acc = sparse(tmp_path)
    assert isinstance(acc.make_selector(), HybridSelector)
    assert acc.selection == SelectionConfig(Budget.tokens(1024), 128, 256)
    o = acc.options
    assert (o.page_tokens, o.reselect_every, o.rank, o.min_context_tokens) == (16, 1, 16, 1024)


def test_the_selection_it_configures_is_the_one_a_selector_makes(tmp_path):
    _, acc = sparse(tmp_path, selector="sinklocal", budget={"tokens": 64}, sink_tokens=64, local_tokens=128)
    step = LayerStep(np.ones((4, 8), np.float32), n_tokens=1024, unit_tokens=16, kv_heads=2)
    got = acc.make_selector().select(step, acc.selection)
    assert isinstance(acc.make_selector(), SinkLocalSelector)
    assert got.ranges == ((0, 64), (832, 1024))  # sink, the local window and 64 tokens picked before it
    assert (got.kept_tokens, got.extra_tokens) == (192, 64)


@pytest.mark.parametrize("options, where", [
    ({"selector": "qwest"}, r"accelerators\.0\.options\.selector: unknown selector 'qwest'; allowed: \["),
    ({"budget": {"pages": 3}}, r"accelerators\.0\.options\.budget: must be a mapping with one key of "
                               r"\['tokens', 'ratio', 'top_p'\]"),
    ({"budget": {"top_p": 1.5}}, r"accelerators\.0\.options\.budget: Budget top_p: value must be a number in"),
    ({"page_tokens": 0}, r"accelerators\.0\.options\.page_tokens"),
    ({"selector": "lowrank", "rank": 32, "min_context_tokens": 40},
     r"accelerators\.0\.options\.min_context_tokens: 40 is below rank \+ page_tokens \(32 \+ 16\)"),
    ({"summary_capacity_bytes": "0B"}, r"accelerators\.0\.options\.summary_capacity_bytes"),
    ({"window": 3}, r"accelerators\.0\.options\.window: unknown key; allowed: \[.*'budget'"),
])
def test_a_bad_option_is_a_config_error_naming_the_key(tmp_path, options, where):
    with pytest.raises(ConfigError, match=where):
        load_config(conf(tmp_path, [{"name": "sparse", "options": options}]), environ={})


def test_pages_must_divide_the_block_and_rank_must_fit_the_head(tmp_path):
    with pytest.raises(ConfigError, match=r"page_tokens 48 does not divide block_tokens 256"):
        sparse(tmp_path, page_tokens=48)
    _, acc = sparse(tmp_path, selector="hybrid", rank=32)
    acc.check_block_tokens(128)
    with pytest.raises(ConfigError, match=r"page_tokens 16 does not divide the engine's block size 40"):
        acc.check_block_tokens(40)
    acc.check_head_dim(64)
    with pytest.raises(ConfigError, match=r"options\.rank 32 must be at most the model's head size 16"):
        acc.check_head_dim(16)
    _, quest = sparse(tmp_path, selector="quest", rank=32)
    quest.check_head_dim(16)  # quest reads no projected keys: its rank is unused


def test_the_engine_chain_holds_it_and_the_cache_chain_does_not(tmp_path):
    raw = conf(tmp_path, [{"name": "prefetch"}, {"name": "sparse", "options": {"selector": "quest"}}])
    with UnifiedCache(raw) as cache:
        assert cache.accelerators.names == ["prefetch"]
        assert cache.accelerators.get(SparseAccelerator) is None
        assert isinstance(cache.accelerators.get(PrefetchAccelerator), PrefetchAccelerator)
        engine = Accelerators.build(cache.config, cache, runs_in="engine")
        try:
            assert engine.names == ["sparse"]
            acc = engine.get(SparseAccelerator)
            assert isinstance(acc, SparseAccelerator) and acc.cache is cache
            assert engine.get(PrefetchAccelerator) is None
        finally:
            engine.close()


def test_without_an_entry_sparse_decode_is_off(tmp_path):
    cfg = load_config(conf(tmp_path, []), environ={})
    assert Accelerators.build(cfg, cache=None, runs_in="engine").get(SparseAccelerator) is None


def test_an_unknown_place_to_run_is_refused(tmp_path):
    cfg = load_config(conf(tmp_path, []), environ={})
    with pytest.raises(ArgumentError, match=r"runs_in 'gpu' not one of \['cache', 'engine'\]"):
        Accelerators.build(cfg, cache=None, runs_in="gpu")


def test_the_connectors_figures_are_its_counters(tmp_path):
    _, acc = sparse(tmp_path)
    acc.record({"decode_steps": 2, "sparse_layer_steps": 10})
    acc.record({"decode_steps": 1, "dense_fallbacks": 1})
    assert acc.counters() == {"decode_steps": 3, "sparse_layer_steps": 10, "dense_fallbacks": 1}
    chain = Accelerators([acc])
    assert chain.stats() == {"sparse": {"decode_steps": 3, "sparse_layer_steps": 10, "dense_fallbacks": 1,
                                        "errors": 0}}
