"""CircuitBreaker: calls stop for retry_after_s after a failure, and while a
probe says the server is down; each outage is counted once."""
import pytest

from ucm.adapters.cluster import CircuitBreaker
from ucm.errors import ArgumentError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_trip_refuses_calls_for_retry_after_s():
    clock = Clock()
    b = CircuitBreaker("redis", "redis://h:1", retry_after_s=2.0, clock=clock)
    assert b.allows() and not b.down and b.outages == 0
    b.trip(OSError("refused"))
    assert not b.allows() and b.down
    clock.now += 1.0
    b.trip(OSError("refused"))  # the same outage: extends it, counted once
    clock.now += 1.9
    assert not b.allows()
    clock.now += 0.2
    assert b.allows() and b.outages == 1
    b.trip(-900)
    assert b.outages == 2


def test_a_probe_holds_calls_until_the_server_is_back(caplog):
    caplog.set_level("INFO", logger="ucm.adapters.cluster.breaker")
    clock = Clock()
    b = CircuitBreaker("mooncake", "master h:1", retry_after_s=0.0, clock=clock)
    b.probed(True)
    assert b.allows() and b.outages == 0
    b.probed(False)
    b.probed(False)
    assert not b.allows() and not b.healthy and b.outages == 1
    clock.now += 1000
    assert not b.allows()  # time alone does not close it: the probe must say so
    b.probed(True)
    assert b.allows() and b.healthy
    assert "master h:1 is back" in caplog.text


def test_a_negative_retry_is_a_config_error():
    with pytest.raises(ArgumentError):
        CircuitBreaker("redis", "x", retry_after_s=-1)
