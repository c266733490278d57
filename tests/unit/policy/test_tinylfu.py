"""W-TinyLFU: the window keeps what was just stored, the sketch guards the main area."""
import random

from ucm.bench.cache.replay import CostModel, TraceReplay
from ucm.placement import TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy
from ucm.bench.cache.traces import TraceRequest


def replay(policy, reqs, blocks):
    p = make_placement([TierSpec("dram", blocks)], load_policy(policy), heat=HeatTracker())
    return TraceReplay(p, CostModel(block_bytes=1), policy_name=policy).replay(reqs)


def requests(rows):
    return [TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids))
            for i, ids in enumerate(rows)]


def test_a_new_prompt_asked_again_at_once_hits_like_lru():
    """Each new prompt comes back in the next request: admission alone
    (TinyLFU in front of LRU) would refuse it the first time."""
    rnd = random.Random(1)
    counter = iter(range(1 << 40))
    rows = []
    for _ in range(400):
        ids = [next(counter) for _ in range(rnd.randint(2, 5))]
        rows += [ids, ids]
    reqs = requests(rows)
    lru, tiny = replay("lru", reqs, 40), replay("tinylfu", reqs, 40)
    assert tiny.hit_ratio >= 0.95 * lru.hit_ratio > 0.3


def test_hot_prompts_survive_a_scan():
    """Ten hot prompts asked over and over, interleaved with a long scan of
    one-shot prompts: the frequency sketch keeps the hot ones in the main area."""
    counter = iter(range(1 << 40))
    hot = [[next(counter) for _ in range(3)] for _ in range(10)]
    rows = []
    for i in range(3000):
        rows.append(hot[i // 2 % 10] if i % 2 else [next(counter) for _ in range(4)])
    reqs = requests(rows)
    lru, tiny = replay("lru", reqs, 36), replay("tinylfu", reqs, 36)
    assert tiny.hit_ratio > lru.hit_ratio + 0.1
