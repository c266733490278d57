"""The config loader on random mappings, YAML text and environment
overrides: the answer is a UcmConfig or a ConfigError (a UcmError and a
ValueError) that names a key; no TypeError, KeyError, OverflowError or
plain ValueError escapes."""
import copy
import re
from pathlib import Path

import pytest
import yaml

from fuzzing import SEED, STRINGS, examples, mutate, rng, scalar, value
from ucm.config.schema import UcmConfig, load_config
from ucm.errors import ConfigError, UcmError

BIG = "9" * 400 + "GiB"  # overflows the float parse_size multiplies in
ROOT = Path(__file__).resolve().parents[2]
BASES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "configs").glob("*.yaml"))] + [
    {"tiers": [{"adapter": "dram", "capacity": "4MiB", "options": {"path": "/dev/shm", "copy_threads": 2}},
               {"adapter": "fs", "capacity": "1GiB",
                "options": {"path": "/nonexistent/fs", "key_prefix": "ucm", "shard_levels": 2, "on_full": "evict"}}],
     "policy": {"name": "lru"}, "service": {"socket": "/tmp/x.sock", "max_frame_bytes": "1MiB", "index_slots": 1024}},
    {"tiers": [{"adapter": "hbm", "capacity": "1GiB", "options": {"device": "cpu"}},
               {"adapter": "dram", "capacity": 1 << 30}], "landing_tier": "dram", "policy": {"name": "s3fifo"}},
]
# every key of the schema and of the adapters' options, so mutations also add known keys in wrong places
KNOWN = sorted({"block_tokens", "tiers", "landing_tier", "policy", "heat", "io_workers", "service", "adapter",
                "capacity", "options", "headroom", "name", "half_life_requests", "socket", "metrics_port",
                "max_frame_bytes", "max_keys", "poll_spin_us", "index_slots", "path", "region_size",
                "io_chunk", "url", "master", "key_prefix", "shard_levels", "file_mode", "prefault"})


def paths(node, prefix=()):
    """Every (path, value) inside a parsed config."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


def mutated(rnd):
    """A copy of a base config with 1-3 random edits; returns it and the
    top-level keys the edits touched."""
    cfg = copy.deepcopy(rnd.choice(BASES))
    touched = set()
    for _ in range(rnd.randint(1, 3)):
        path, node = rnd.choice(list(paths(cfg))[1:])
        parent = cfg
        for p in path[:-1]:
            parent = parent[p]
        touched.add(path[0])
        r = rnd.random()
        if r < 0.15:
            del parent[path[-1]]
        elif r < 0.3 and isinstance(node, dict):
            node[rnd.choice(KNOWN + ["bogus"])] = scalar(rnd)
        elif r < 0.4 and isinstance(node, list):
            node.append(copy.deepcopy(rnd.choice(node)) if node and rnd.random() < 0.5 else value(rnd, 2))
        else:
            parent[path[-1]] = value(rnd, 2) if rnd.random() < 0.3 else scalar(rnd)
    return cfg, touched


def check(source, environ, touched=()):
    try:
        cfg = load_config(source, environ=environ)
    except ConfigError as exc:
        msg = str(exc)
        assert isinstance(exc, UcmError) and isinstance(exc, ValueError)
        assert msg and (not touched or any(str(t) in msg for t in touched) or "(top level)" in msg
                        or "UCM_" in msg or "config" in msg), (SEED, source, msg)
        return None
    assert isinstance(cfg, UcmConfig)
    assert cfg.tiers and all(t.capacity > 0 for t in cfg.tiers)
    return cfg


def test_mutated_mappings_load_or_raise_config_error():
    rnd = rng("config_mappings")
    loaded = refused = 0
    for n in range(examples(500)):
        cfg, touched = mutated(rnd)
        if check(cfg, {}, touched) is None:
            refused += 1
        else:
            loaded += 1
    assert loaded and refused


def test_random_top_levels_raise_config_error():
    rnd = rng("config_top")
    for n in range(examples(500)):
        raw = value(rnd, 3)
        if isinstance(raw, dict):
            check(raw, {})
        else:
            try:
                load_config(raw, environ={})
            except ConfigError:
                pass
            except (TypeError, AttributeError) as exc:  # not a path nor a mapping: a caller's bug, not config
                assert not isinstance(raw, (str, dict)), (SEED, raw, exc)


def test_mutated_yaml_files_load_or_raise_config_error(tmp_path):
    rnd = rng("config_yaml")
    texts = [p.read_bytes() for p in sorted((ROOT / "configs").glob("*.yaml"))]
    texts += [yaml.safe_dump(b).encode() for b in BASES]
    path = tmp_path / "ucm.yaml"
    for n in range(examples(300)):
        data = mutate(rnd, rnd.choice(texts), rounds=rnd.randint(1, 6))
        if rnd.random() < 0.1:
            data = rnd.choice((b"!!python/object/apply:os.system ['true']\n", b"a: &x [*x]\n",
                               b"- 1\n- 2\n", b"\xff\xfe\x00", b"a: !!binary AAAA\n", b"tiers: {}\n",
                               b"block_tokens: 1e400\n", b"? [1, 2]\n: 3\n", b"{1: 2}\n"))
        path.write_bytes(data)
        check(str(path), {})


def test_random_environment_overrides_load_or_raise_config_error():
    rnd = rng("config_env")
    var_parts = ["TIERS", "DRAM", "NVME", "FS", "0", "1", "7", "CAPACITY", "OPTIONS", "PATH", "REGION_SIZE",
                 "HEADROOM", "POLICY", "NAME", "OPTIONS", "SERVICE", "MAX_KEYS", "BLOCK_TOKENS", "HEAT",
                 "HALF_LIFE_REQUESTS", "LANDING_TIER", "IO_WORKERS", "BOGUS", ""]
    for n in range(examples(500)):
        env = {}
        for _ in range(rnd.randint(1, 3)):
            var = "UCM_" + "__".join(rnd.choice(var_parts) for _ in range(rnd.randint(1, 4)))
            env[var] = rnd.choice(STRINGS + ["[1, 2]", "{a: 1}", "- x", "'", "&a [*a]", "2", "0.1", "64MiB"])
        check(copy.deepcopy(rnd.choice(BASES)), env)


@pytest.mark.parametrize("raw,needle", [
    ({"tiers": [{"adapter": "dram", "capacity": BIG}]}, "tiers.0.capacity: invalid size"),
    ({"service": {"max_frame_bytes": BIG}}, "service.max_frame_bytes: invalid size"),
    ({"tiers": [{"adapter": "dram", "capacity": "1GiB"},
                {"adapter": "nvme", "capacity": "1GiB", "options": {"path": "/x", "region_size": BIG}}]},
     "tiers.1.options.region_size: invalid size"),
])
def test_a_size_past_float_range_is_a_config_error_naming_the_key(raw, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(raw, environ={})


@pytest.mark.parametrize("value", ["\x00", "[" * 5000])
def test_an_override_that_is_not_yaml_is_a_config_error_naming_the_variable(value):
    with pytest.raises(ConfigError, match="^UCM_BLOCK_TOKENS: the value is not valid YAML"):
        load_config({}, environ={"UCM_BLOCK_TOKENS": value})


@pytest.mark.parametrize("name,data,needle", [
    ("deep.yaml", b"block_tokens: " + b"[" * 5000, "is not valid YAML"),
    ("latin1.yaml", b"service:\n  name: caf\xe9\n", "cannot read config file"),
    ("a\x00b.yaml", None, "cannot read config file"),
])
def test_an_unreadable_config_file_is_a_config_error(tmp_path, name, data, needle):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(ConfigError, match=needle):
        load_config(str(path), environ={})
