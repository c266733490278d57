"""The accelerator layer: configuration, loading, hook isolation, and the
hooks the cache calls (ucm/accelerators/base.py, chain.py)."""
import logging
import threading

import pytest

import ucm.accelerators.base as base
from ucm.accelerators.base import Accelerator, AcceleratorOptions, RequestSeen
from ucm.accelerators.chain import Accelerators
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache
from ucm.config.schema import UcmConfig, load_config
from ucm.errors import ConfigError


def conf(tmp_path, accelerators):
    return {"tiers": [{"adapter": "dram", "capacity": "1MiB", "options": {"path": str(tmp_path)}}],
            "policy": {"name": "lru"}, "accelerators": accelerators}


def key(i):
    return i.to_bytes(16, "little")


class Recorder(Accelerator):
    """Records every hook it receives; raises in the hooks named in `boom`."""

    name = "recorder"

    class Config(AcceleratorOptions):
        boom: tuple[str, ...] = ()

    def __init__(self, cache, config, **options):
        super().__init__(cache, config, **options)
        self.events = []
        self.closed = 0

    def _hook(self, hook, event):
        self.events.append((hook, event))
        if hook in self.options.boom:
            raise RuntimeError(f"injected: {hook}")

    def request_seen(self, event):
        self._hook("request_seen", event)

    def blocks_stored(self, event):
        self._hook("blocks_stored", event)

    def blocks_loaded(self, event):
        self._hook("blocks_loaded", event)

    def request_finished(self, event):
        self._hook("request_finished", event)

    def counters(self):
        return {"events": len(self.events)}

    def close(self):
        self.closed += 1


class FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"tests:{name}", target
        self.group = base.ACCELERATOR_NAMESPACE

    def load(self):
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


@pytest.fixture
def installed(monkeypatch):
    """Replaces the `ucm.accelerators` entry points with the given ones."""
    import importlib.metadata

    real = importlib.metadata.entry_points

    def install(**targets):
        eps = [FakeEntryPoint(n, t) for n, t in targets.items()]

        def entry_points(**kw):
            if kw.get("group") == base.ACCELERATOR_NAMESPACE:
                return eps
            return real(**kw)

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    return install


def test_the_shipped_prefetch_is_installed_and_configurable(tmp_path):
    assert "prefetch" in base.accelerator_names()
    cfg = load_config(conf(tmp_path, [{"name": "prefetch", "options": {"max_inflight_blocks": 8}}]), environ={})
    assert cfg.accelerators[0].name == "prefetch"


def test_an_unknown_accelerator_is_a_config_error_listing_the_installed(tmp_path):
    with pytest.raises(ConfigError, match=r"accelerators\.0\.name: unknown accelerator 'prefech'; "
                                          r"installed: \[.*'prefetch'"):
        load_config(conf(tmp_path, [{"name": "prefech"}]), environ={})


def test_an_unknown_option_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"accelerators\.0\.options\.depth: unknown key; allowed: "
                                          r"\['max_inflight_blocks', 'max_staged_bytes', 'stale_after_s', 'track_blocks'\]"):
        load_config(conf(tmp_path, [{"name": "prefetch", "options": {"depth": 2}}]), environ={})
    with pytest.raises(ConfigError, match=r"accelerators\.0\.options\.max_inflight_blocks"):
        load_config(conf(tmp_path, [{"name": "prefetch", "options": {"max_inflight_blocks": 0}}]), environ={})
    with pytest.raises(ConfigError, match=r"accelerators\.0\.bogus"):
        load_config(conf(tmp_path, [{"name": "prefetch", "bogus": 1}]), environ={})


def test_an_accelerator_listed_twice_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="each accelerator may appear once"):
        load_config(conf(tmp_path, [{"name": "prefetch"}, {"name": "prefetch"}]), environ={})


def test_an_entry_point_that_fails_to_load_is_an_error_naming_it(tmp_path, installed):
    installed(broken=ImportError("No module named 'acme_accel'"))
    with pytest.raises(ConfigError, match=r"accelerators\.0\.name: accelerator entry point broken = "
                                          r"'tests:broken' failed to load: ImportError"):
        load_config(conf(tmp_path, [{"name": "broken"}]), environ={})
    installed(notone=dict)
    with pytest.raises(ConfigError, match="is not a ucm.accelerators.base.Accelerator subclass"):
        load_config(conf(tmp_path, [{"name": "notone"}]), environ={})


def test_an_accelerator_that_runs_nowhere_known_is_an_error_naming_it(tmp_path, installed):
    class Elsewhere(Recorder):
        runs_in = "gpu"

    installed(elsewhere=Elsewhere)
    with pytest.raises(ConfigError, match=r"accelerators\.0\.name: accelerator entry point elsewhere = "
                                          r"'tests:elsewhere' declares runs_in 'gpu', not one of "
                                          r"\['cache', 'engine'\]"):
        load_config(conf(tmp_path, [{"name": "elsewhere"}]), environ={})


def test_an_accelerator_that_fails_to_start_fails_the_cache_and_leaves_nothing(tmp_path, installed):
    class Broken(Recorder):
        def __init__(self, cache, config, **options):
            raise OSError("injected: no device")

    installed(recorder=Recorder, broken=Broken)
    with pytest.raises(ConfigError, match=r"accelerators\.1: accelerator 'broken' failed to start: OSError"):
        UnifiedCache(UcmConfig.model_validate(conf(tmp_path, [{"name": "recorder"}, {"name": "broken"}])))
    import os
    assert os.listdir(tmp_path) == []


def test_the_cache_calls_every_hook_with_what_happened(tmp_path, installed):
    installed(recorder=Recorder)
    with UnifiedCache(conf(tmp_path, [{"name": "recorder"}])) as cache:
        acc = cache.accelerators.members[0]
        keys = [key(i) for i in range(3)]
        assert cache.store(keys[:2], [b"a" * 100, b"b" * 100]).wait(10) == [Outcome.DONE] * 2
        cache.begin_request("r1", keys)
        cache.begin_request("r1", keys)  # seen once
        got = [bytearray(100) for _ in range(3)]
        assert cache.load(keys, got, request_id="r1").wait(10) == [Outcome.DONE] * 2 + [Outcome.MISSING]
        cache.finish(keys, 7, request_id="r1")
        hooks = [h for h, _ in acc.events]
        assert hooks == ["blocks_stored", "request_seen", "blocks_loaded", "request_finished"]
        stored, seen, loaded, finished = (e for _, e in acc.events)
        assert stored.keys == tuple(keys[:2]) and stored.sizes == (100, 100) and stored.tier == "dram"
        slot = cache.adapters[0].footprint_bytes(100)  # what the tier accounts for a 100-byte block
        assert seen == RequestSeen("r1", tuple(keys), None, ("dram", "dram", None), (slot, slot, 0))
        assert loaded.outcomes == (Outcome.DONE, Outcome.DONE, Outcome.MISSING)
        assert loaded.tiers == ("dram", "dram", None) and loaded.request_id == "r1"
        assert finished.output_tokens == 7 and finished.request_id == "r1"
        assert cache.stats()["accelerators"] == {"recorder": {"events": 4, "errors": 0}}
    assert acc.closed == 1


def test_a_hook_that_raises_is_counted_never_raised_into_the_caller(tmp_path, installed, caplog):
    installed(recorder=Recorder)
    boom = {"name": "recorder", "options": {"boom": ["request_seen", "blocks_stored", "blocks_loaded",
                                                     "request_finished"]}}
    with UnifiedCache(conf(tmp_path, [boom])) as cache, caplog.at_level(logging.WARNING):
        keys = [key(i) for i in range(2)]
        assert cache.store(keys, [b"a" * 10, b"b" * 10]).wait(10) == [Outcome.DONE] * 2
        cache.begin_request("r1", keys)
        got = [bytearray(10) for _ in keys]
        assert cache.load(keys, got, request_id="r1").wait(10) == [Outcome.DONE] * 2
        assert bytes(got[0]) == b"a" * 10
        cache.finish(keys, 1, request_id="r1")
        assert cache.stats()["accelerators"]["recorder"]["errors"] == 4
    assert sum("accelerator recorder" in r.message for r in caplog.records) == 1  # the first one, once


def test_hooks_run_in_config_order_and_a_failing_one_does_not_stop_the_next():
    seen = []

    class A(Accelerator):
        name = "a"

        def request_seen(self, event):
            seen.append("a")
            raise RuntimeError("injected")

    class B(Accelerator):
        name = "b"

        def request_seen(self, event):
            seen.append("b")

    accs = Accelerators([A(None, None), B(None, None)])
    accs.request_seen(RequestSeen("r", (), None, (), ()))
    assert seen == ["a", "b"]
    assert accs.stats() == {"a": {"errors": 1}, "b": {"errors": 0}}


def test_a_handle_calls_back_once_done():
    from ucm.api import Handle

    h = Handle(2)
    got = []
    h.add_done_callback(lambda x: got.append(x.results))
    assert got == []
    t = threading.Thread(target=h.resolve, args=([Outcome.DONE, Outcome.MISSING],))
    t.start()
    t.join()
    assert got == [[Outcome.DONE, Outcome.MISSING]]
    h.add_done_callback(lambda x: got.append("late"))  # already done: at once
    assert got[-1] == "late"
    h.add_done_callback(lambda x: 1 / 0)  # logged, not raised
