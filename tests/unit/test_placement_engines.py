"""The placement engines against their one interface: both implement every
member of `PlacementEngine` with its signature, and `make_placement` picks
the engine the module docstring of ucm/placement/factory.py promises.
(tests/unit/test_placement_native.py compares their decisions.)"""
import inspect

import pytest

from ucm.errors import ArgumentError
from ucm.placement import Placement, PlacementEngine, TierSpec, make_placement
from ucm.placement.engine import PythonPlacement
from ucm.placement.heat import HeatTracker
from ucm.placement.native import NativePlacement
from ucm.placement.policies.base import load_policy

ENGINES = {"python": PythonPlacement, "native": NativePlacement}
METHODS = sorted(n for n, v in vars(PlacementEngine).items()
                 if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property)))
DATA = sorted(PlacementEngine.__annotations__)


def specs():
    return [TierSpec("dram", 4), TierSpec("nvme", 8)]


def test_the_protocol_names_what_the_callers_use():
    assert {"insert", "insert_run", "promote", "reclaim", "remove", "evict_keys", "may_evict", "record_request",
            "touch", "pin", "hold", "watch", "tier_count"} <= set(METHODS)
    assert DATA == ["heat", "landing", "native"]


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("name", METHODS)
def test_each_engine_defines_each_method_with_the_protocols_signature(engine, name):
    cls = ENGINES[engine]
    want, got = vars(PlacementEngine)[name], cls.__dict__.get(name)
    assert got is not None, f"{cls.__name__} lacks {name}"
    if isinstance(want, property):
        assert isinstance(got, property)
        return
    assert inspect.signature(got) == inspect.signature(want)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_engine_is_a_placement_engine(engine):
    p = make_placement(specs(), load_policy("lru"), HeatTracker(), landing=1, engine=engine)
    assert type(p) is ENGINES[engine]
    assert isinstance(p, PlacementEngine)
    assert p.native is (engine == "native")
    assert p.landing == 1 and isinstance(p.heat, HeatTracker)


def test_auto_picks_native_where_it_can_run_and_python_elsewhere():
    lru = load_policy("lru")
    assert type(make_placement(specs(), lru)) is NativePlacement
    # a factory that is not a BoundPolicy from load_policy has no native twin
    assert type(make_placement(specs(), lambda info, heat: lru(info, heat))) is PythonPlacement


def test_native_says_why_it_cannot_run():
    heat = HeatTracker()
    heat.tick()
    heat.touch((1).to_bytes(16, "little"))
    with pytest.raises(ArgumentError, match="native placement unavailable: the HeatTracker already has history"):
        make_placement(specs(), load_policy("lru"), heat, engine="native")


def test_an_unknown_engine_is_refused_naming_the_allowed_ones():
    with pytest.raises(ArgumentError, match=r"placement engine 'cuda' not one of \['auto', 'native', 'python'\]"):
        make_placement(specs(), load_policy("lru"), engine="cuda")


@pytest.mark.parametrize("native, cls", [(None, NativePlacement), (True, NativePlacement),
                                         (False, PythonPlacement)])
def test_the_older_spelling_maps_native_onto_the_engine(native, cls):
    assert type(Placement(specs(), load_policy("lru"), native=native)) is cls
