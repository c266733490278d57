"""HeatTracker: a history bounded in bytes, compact records, and the events listeners get."""
import pytest

from ucm.config.schema import HeatConfig, load_config
from ucm.errors import ArgumentError, ConfigError
from ucm.placement.heat import DEFAULT_HISTORY_BYTES, RECORD_BYTES, HeatTracker
from ucm.placement.policies.reuse import ReuseModel


def key(i):
    return i.to_bytes(16, "little")


class Recorder:
    def __init__(self):
        self.events = []

    def on_access(self, k, slot, now, first, ext):
        self.events.append(("access", k, now, first, ext))

    def on_tick(self, now):
        self.events.append(("tick", now))

    def on_forget(self, k, slot, now):
        self.events.append(("forget", k, now))

    def on_reclass(self, k, slot, now, long_out):
        self.events.append(("reclass", k, now, long_out))


def test_history_is_sized_in_bytes_and_forgets_the_least_recent():
    heat = HeatTracker(history_bytes=3 * RECORD_BYTES)
    assert heat.history_blocks == 3
    heat.tick()
    for i in range(3):
        heat.touch(key(i))
    heat.touch(key(0))  # key 0 is now the most recent
    heat.touch(key(3))
    assert heat.get(key(1)) is None and heat.get(key(0)).count == 2 and len(heat) == 3
    assert HeatTracker().history_blocks == DEFAULT_HISTORY_BYTES // RECORD_BYTES


def test_bad_history_sizes_are_refused():
    with pytest.raises(ArgumentError, match="history_bytes"):
        HeatTracker(history_bytes=RECORD_BYTES - 1)
    with pytest.raises(ConfigError, match=r"heat\.history_bytes.*at least 1MiB"):
        load_config({"heat": {"history_bytes": "4KiB"}})
    with pytest.raises(ConfigError, match=r"heat\.history_bytes"):
        load_config({"heat": {"history_bytes": "a lot"}})
    assert load_config({"heat": {"history_bytes": "64MiB"}}).heat.history_bytes == 64 << 20
    assert HeatConfig().history_bytes == DEFAULT_HISTORY_BYTES


def test_listeners_get_access_tick_forget_and_reclass_in_order():
    heat = HeatTracker(history_blocks=2)
    rec = Recorder()
    heat.subscribe(rec)
    heat.subscribe(rec)  # once only
    a, b, c = key(1), key(2), key(3)
    heat.tick()
    heat.touch(b, parent=a)
    heat.touch(a)
    heat.tick()
    heat.touch(c, parent=b)  # b was seen before: c is new text behind a known prefix
    assert heat.finish([c, key(9)], 500) == [c]
    assert rec.events == [
        ("tick", 1), ("access", b, 1, True, False), ("access", a, 1, False, False),
        ("tick", 2), ("forget", b, 2), ("access", c, 2, True, False),
        ("reclass", c, 2, True),
    ]
    assert heat.listener(Recorder) is rec and heat.listener(ReuseModel) is None


def test_the_reuse_model_reads_records_and_never_writes_them():
    heat = HeatTracker()
    model = ReuseModel.of(heat)
    assert ReuseModel.of(heat) is model  # one model per tracker, shared by its policies
    a = key(1)
    heat.tick()
    heat.touch(a)
    before = heat.get(a)
    heat.finish([a], 500)
    after = heat.get(a)
    assert after.long_out and not before.long_out  # the tracker changed its own record
    heat.forget(a)
    assert heat.get(a) is None and model.alive.sum() == 0.0


def test_a_record_forgotten_in_the_tick_of_its_access_leaves_no_episode_behind():
    heat = HeatTracker(history_blocks=1)
    model = ReuseModel.of(heat)
    heat.tick()
    heat.touch(key(1))
    heat.touch(key(2))  # forgets key 1, whose slot key 2 takes at once
    for _ in range(8):
        heat.tick()
    assert model.alive.sum() == 1.0
    assert model.exposure.sum() == 8.0


@pytest.mark.parametrize("history", [40, 1000])  # records forgotten all along / never
@pytest.mark.parametrize("listening", [False, True])
def test_touch_request_records_exactly_what_touches_deepest_first_would(listening, history):
    import random

    rnd = random.Random(5)
    a, b = HeatTracker(30, history_blocks=history), HeatTracker(30, history_blocks=history)
    recs = [Recorder(), Recorder()]
    if listening:
        a.subscribe(recs[0])
        b.subscribe(recs[1])
    for step in range(400):
        keys = [key(rnd.randrange(80 + step)) for _ in range(rnd.randint(0, 8))]  # repeats, new, forgotten
        parent = rnd.choice([None, key(rnd.randrange(80 + step))] + keys[:1])  # keys[0] its own parent too
        nus = [float(rnd.randrange(1000)) for _ in keys] if step % 2 else None
        a.tick()
        for i in range(len(keys) - 1, 0, -1):
            a.touch(keys[i], keys[i - 1], nus[i] if nus else float("inf"))
        if keys:
            a.touch(keys[0], parent, nus[0] if nus else float("inf"))
        b.tick()
        b.touch_request(keys, parent, nus)
        if step % 7 == 0:
            changed = [key(rnd.randrange(80)) for _ in range(3)]
            assert a.finish(changed, 500) == b.finish(changed, 500)
    assert len(a) == len(b) and list(a._slots) == list(b._slots)
    for i in range(480):
        assert a.get(key(i)) == b.get(key(i))
    assert recs[0].events == recs[1].events
