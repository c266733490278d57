"""TierStack (ucm/tiers/stack.py) over real adapters, one of them wrapped to
fail (ucm.adapters.faults): a tier that raises is a failed step, logged,
never an exception out of `run`."""
import logging
import os

from ucm.adapters.base import Status, load_adapter_class
from ucm.adapters.dram import DramAdapter, DramConfig
from ucm.adapters.faults import FaultyAdapter
from ucm.placement.plans import Op, Step
from ucm.tiers.stack import TierStack

SIZE = 64 << 10


class SizeFailsOnSecondAsk(FaultyAdapter):
    """A source tier whose `size_of` answers once, then raises (a tier that
    breaks between two calls)."""

    asked = 0

    def size_of(self, key):
        self.asked += 1
        if self.asked > 1:
            raise RuntimeError("injected: size_of")
        return super().size_of(key)


def test_a_tier_that_raises_while_a_failed_copy_is_sized_is_logged_and_a_failure(tmp_path, caplog):
    dram = DramAdapter(4 * SIZE, DramConfig(path=str(tmp_path), prefault=False))
    fs_cls = load_adapter_class("fs")
    fs = SizeFailsOnSecondAsk(fs_cls(capacity_bytes=16 * SIZE, config=fs_cls.Config(path=str(tmp_path / "fs"))))
    stack = TierStack([dram, fs], ["dram", "fs"])
    try:
        full = [os.urandom(16) for _ in range(4)]
        assert dram.put(full, [os.urandom(SIZE) for _ in full]) == [Status.OK] * 4  # no slot left
        key = os.urandom(16)
        assert fs.put([key], [os.urandom(SIZE)]) == [Status.OK]
        ticket = stack.admit([Step(Op.COPY, key, src=1, dst=0)], lambda k: None)
        with caplog.at_level(logging.WARNING, logger="ucm.tiers.stack"):
            failures = stack.run(ticket, {})
        assert [(f.status, f.size_bytes) for f in failures] == [(Status.NO_SPACE, None)]  # the block's size unknown
        for f in failures:
            stack.done(f)
        assert stack.pending_steps() == 0
        logged = [r for r in caplog.records if r.name == "ucm.tiers.stack" and r.levelno >= logging.WARNING
                  and r.exc_info is not None and "injected: size_of" in str(r.exc_info[1])]
        assert logged, [r.getMessage() for r in caplog.records]
    finally:
        stack.close()
