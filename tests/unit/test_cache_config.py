"""UnifiedCache's construction: policy options and replay-only policies are
typed configuration errors, and a construction that fails half-way leaves
no arena file behind (review 0a4baf9, item 12)."""
import os

import pytest

import ucm.cache.unified
from ucm.cache.unified import UnifiedCache
from ucm.config.schema import UcmConfig, load_config
from ucm.errors import ConfigError
from ucm.placement.policies.base import load_policy


def dram_only(tmp_path, **policy):
    return {"tiers": [{"adapter": "dram", "capacity": "1MiB", "options": {"path": str(tmp_path)}}],
            "policy": {"name": "lru", **policy}}


def test_unknown_policy_option_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.options\.size: unknown key; allowed: \[\]"):
        load_config(dram_only(tmp_path, options={"size": 1}), environ={})
    with pytest.raises(ConfigError, match=r"policy\.options\.size"):
        load_policy("heat", size=1)


def test_a_replay_only_policy_is_refused_for_a_live_cache(tmp_path):
    cfg = dram_only(tmp_path)
    cfg["policy"]["name"] = "opt"
    with pytest.raises(ConfigError, match=r"policy\.name: 'opt' is for trace replay only.*live policies: \[.*'lru'"):
        load_config(cfg, environ={})
    with pytest.raises(ConfigError, match="trace replay only"):
        UnifiedCache(UcmConfig.model_validate(cfg))  # built in code: load_config never saw it
    assert os.listdir(tmp_path) == []
    assert load_policy("opt") is not None  # the replay still has it


def test_bad_options_in_a_config_built_in_code_leave_nothing_behind(tmp_path):
    with pytest.raises(ConfigError, match=r"policy\.options\.size"):
        UnifiedCache(UcmConfig.model_validate(dram_only(tmp_path, options={"size": 1})))
    assert os.listdir(tmp_path) == []


def test_a_construction_that_fails_after_a_tier_opened_closes_it(tmp_path):
    """The second tier fails to open (through the tier_factory seam): the
    first one, already open, is closed and its arena file removed."""
    def factory(index, cls, capacity, options):
        if index == 1:
            raise OSError("injected: the medium is not there")
        return cls(capacity_bytes=capacity, config=options)

    conf = dram_only(tmp_path)
    conf["tiers"].append({"adapter": "nvme", "capacity": "8MiB", "options": {"path": str(tmp_path / "nvme")}})
    with pytest.raises(OSError, match="injected"):
        UnifiedCache(conf, tier_factory=factory)
    assert [p for p in os.listdir(tmp_path) if p != "nvme"] == []  # the arena file went with it


def test_a_construction_that_fails_after_the_tiers_opened_closes_them(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("placement failed")

    monkeypatch.setattr(ucm.cache.unified, "make_placement", broken)  # past the tiers: nothing else fails there
    with pytest.raises(RuntimeError, match="placement failed"):
        UnifiedCache(dram_only(tmp_path))
    assert os.listdir(tmp_path) == []  # the arena file went with the failed cache


def test_a_cache_dropped_without_close_removes_its_arena_file(tmp_path):
    import gc

    c = UnifiedCache(dram_only(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    del c
    gc.collect()
    assert os.listdir(tmp_path) == []
