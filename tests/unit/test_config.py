from pathlib import Path

import pytest

from ucm.config.schema import load_config
from ucm.errors import ConfigError
from ucm.config.sizes import parse_size

ROOT = Path(__file__).resolve().parents[2]


def two_tiers(tmp_path):
    return {"tiers": [{"adapter": "dram", "capacity": "64MiB"},
                      {"adapter": "nvme", "capacity": "1GiB", "options": {"path": str(tmp_path)}}]}


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path, environ={})
        assert cfg.tiers


def test_sizes():
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    for bad in ("4Gx", "-1", "", "GiB", True, -5):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_defaults_and_frozen(tmp_path):
    cfg = load_config(two_tiers(tmp_path), environ={})
    assert cfg.tiers[0].capacity == 64 << 20 and cfg.block_tokens == 256
    with pytest.raises(Exception):
        cfg.block_tokens = 5


@pytest.mark.parametrize("patch,needle", [
    ({"blocks_tokens": 5}, "blocks_tokens: unknown key; allowed: ["),
    ({"block_tokens": 0}, "block_tokens"),
    ({"landing_tier": "hbm"}, "landing_tier"),
    ({"policy": {"name": "nope"}}, "policy.name: unknown policy 'nope'; installed: ["),
    ({"policy": {"nam": "lru"}}, "policy.nam: unknown key; allowed: ['name', 'options']"),
])
def test_bad_values_name_the_key(tmp_path, patch, needle):
    raw = {**two_tiers(tmp_path), **patch}
    with pytest.raises(ConfigError) as exc:
        load_config(raw, environ={})
    assert needle in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_bad_tier_entries(tmp_path):
    raw = two_tiers(tmp_path)
    raw["tiers"][0]["capacity"] = "4Gx"
    with pytest.raises(ConfigError, match=r"tiers.0.capacity: invalid size '4Gx'; use .*GiB"):
        load_config(raw, environ={})
    raw = two_tiers(tmp_path)
    raw["tiers"][1]["adapter"] = "floppy"
    with pytest.raises(ConfigError, match=r"tiers.1.adapter: unknown adapter 'floppy'; installed: \[.*'dram'.*'nvme'"):
        load_config(raw, environ={})
    raw = two_tiers(tmp_path)
    raw["tiers"][1]["options"]["regoin_size"] = "1MiB"
    with pytest.raises(ConfigError, match=r"tiers.1.options.regoin_size: unknown key; allowed: \[.*'region_size'"):
        load_config(raw, environ={})
    raw = two_tiers(tmp_path)
    raw["tiers"][1]["options"] = {}
    with pytest.raises(ConfigError, match="tiers.1.options.path: required key is missing"):
        load_config(raw, environ={})
    raw = two_tiers(tmp_path)
    raw["tiers"][1]["options"]["region_size"] = 1000
    with pytest.raises(ConfigError, match="region_size: must be a positive multiple of 4096"):
        load_config(raw, environ={})


def test_headroom(tmp_path):
    raw = two_tiers(tmp_path)
    raw["tiers"][0]["headroom"] = "5%"
    assert load_config(raw, environ={}).tiers[0].headroom == pytest.approx(0.05)
    raw["tiers"][0]["headroom"] = 0.2
    assert load_config(raw, environ={}).tiers[0].headroom == pytest.approx(0.2)
    for bad, needle in (("x%", r"tiers.0.headroom: must be a fraction in \[0, 1\) or a percentage"),
                        (1.5, r"tiers.0.headroom: .*less than 1")):
        raw["tiers"][0]["headroom"] = bad
        with pytest.raises(ConfigError, match=needle):
            load_config(raw, environ={})
    raw = two_tiers(tmp_path)
    raw["tiers"][1]["headroom"] = 0.1  # the lowest tier has nowhere to demote to
    with pytest.raises(ConfigError, match="tiers.1.headroom: only a tier with a tier below it"):
        load_config(raw, environ={})


def test_environment_overrides(tmp_path):
    env = {"UCM_BLOCK_TOKENS": "128", "UCM_TIERS__NVME__CAPACITY": "2GiB", "UCM_POLICY__NAME": "lru",
           "UCM_TIERS__0__OPTIONS__PREFAULT": "false", "HOME": "/x"}
    cfg = load_config(two_tiers(tmp_path), environ=env)
    assert cfg.block_tokens == 128
    assert cfg.tiers[1].capacity == 2 << 30
    assert cfg.policy.name == "lru"
    assert cfg.tiers[0].options["prefault"] is False
    with pytest.raises(ConfigError, match="UCM_BLOK_TOKENS: unknown key 'blok_tokens'"):
        load_config(two_tiers(tmp_path), environ={"UCM_BLOK_TOKENS": "1"})
    with pytest.raises(ConfigError, match="UCM_TIERS__SSD__CAPACITY: no tier 'ssd'"):
        load_config(two_tiers(tmp_path), environ={"UCM_TIERS__SSD__CAPACITY": "1GiB"})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad, environ={})


def test_an_impossible_date_in_yaml_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="UCM_POLICY__NAME: the value is not valid YAML"):
        load_config({}, environ={"UCM_POLICY__NAME": "2001-13-45"})
    path = tmp_path / "ucm.yaml"
    path.write_text("policy:\n  name: 2001-13-45\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path, environ={})


def test_ucm_variables_of_other_parts_are_not_config_keys():
    """UCM_MODEL_CACHE (model directories) and UCM_PROGRESS (progress bars)
    set in a shell must not break every config load, e.g. the service that
    `ucm bench service` starts."""
    env = {"UCM_MODEL_CACHE": "/tmp/models", "UCM_PROGRESS": "1", "UCM_BLOCK_TOKENS": "128"}
    assert load_config({}, environ=env).block_tokens == 128
    with pytest.raises(ConfigError, match="UCM_MODEL_CACHES: unknown key"):
        load_config({}, environ={"UCM_MODEL_CACHES": "x"})
