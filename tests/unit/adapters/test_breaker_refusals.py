"""CircuitBreaker.refused: the calls it answered without the server, the
figure the cluster tiers report as `refused_calls`; asking `down` is not a
call."""
from ucm.adapters.cluster import CircuitBreaker


def test_refused_counts_the_calls_answered_without_the_server():
    now = [100.0]
    b = CircuitBreaker("redis", "redis://h:1", retry_after_s=2.0, clock=lambda: now[0])
    assert b.allows() and b.refused == 0
    b.trip(OSError("refused"))
    assert [b.allows() for _ in range(3)] == [False] * 3 and b.refused == 3
    assert b.down and b.down and b.refused == 3  # looking is not a call
    b.probed(False)
    now[0] += 5.0  # the trip ran out, the probe still says down
    assert not b.allows() and b.refused == 4
    b.probed(True)
    assert b.allows() and b.refused == 4
