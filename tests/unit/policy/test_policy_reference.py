"""`lru` and `opt` against straightforward reference implementations.

The references below share no code with the policies or with Placement:
plain dicts and loops over one tier of equal-sized blocks, with the same
rules: prefix semantics (a block hits only if every earlier block of the
request hit), insertion of the missing blocks in order until one is not
placed, the request's blocks reported deepest first, and only leaves (no
resident child) other than the parent of the block being stored may go.
"""
import random

import pytest

from ucm.bench.cache.replay import CostModel, TraceReplay, block_key, next_uses
from ucm.placement import TierSpec, make_placement
from ucm.placement.heat import HeatTracker
from ucm.placement.policies.base import load_policy
from ucm.bench.cache.traces import TraceRequest

INF = float("inf")


def random_trace(seed, n=150, alphabet=3, max_len=7):
    """Requests of chained ids: equal ids iff equal prefixes."""
    rnd = random.Random(seed)
    ids, paths, out = {}, [], []
    for _ in range(n):
        base = ()
        if paths and rnd.random() < 0.75:
            p = rnd.choice(paths)
            base = p[:rnd.randint(1, len(p))]
        path = (base + tuple(rnd.randrange(alphabet) for _ in range(rnd.randint(0, 3))))[:max_len]
        if not path:
            path = (rnd.randrange(alphabet),)
        out.append([ids.setdefault(path[:i + 1], len(ids)) for i in range(len(path))])
        paths.append(path)
    return out


def reference(requests, capacity, policy):
    """Hit prefix length of each request under `lru` or `opt` (Belady with
    bypass: a block whose next use is no nearer than every resident block's
    is not stored)."""
    # next use of each occurrence: the index (1-based clock) of the next request holding the id
    nxt = []
    for i, ids in enumerate(requests):
        row = []
        for h in ids:
            later = [j for j in range(i + 1, len(requests)) if h in requests[j]]
            row.append(later[0] + 1 if later else INF)
        nxt.append(row)
    parent, next_use, stamp, born = {}, {}, {}, {}
    counter = 0
    hits = []
    for i, ids in enumerate(requests):
        for h, nu in zip(ids, nxt[i]):
            next_use[h] = nu
        n = 0
        while n < len(ids) and ids[n] in parent:
            n += 1
        hits.append(n)
        for j in range(n, len(ids)):
            key, up = ids[j], (ids[j - 1] if j else None)
            if len(parent) >= capacity:
                if policy == "opt" and next_use[key] >= max(next_use[k] for k in parent):
                    break
                leaves = [k for k in parent if k != up and all(parent[c] != k for c in parent)]
                if not leaves:
                    break
                if policy == "lru":
                    victim = min(leaves, key=lambda k: stamp[k])
                else:
                    victim = max(leaves, key=lambda k: (next_use[k], born[k]))
                del parent[victim]
            parent[key] = up
            counter += 1
            stamp[key] = born[key] = counter
        for key in reversed(ids):
            if key in parent:
                counter += 1
                stamp[key] = counter
    return hits


def replay_hits(requests, capacity, policy):
    placement = make_placement([TierSpec("dram", capacity)], load_policy(policy), heat=HeatTracker())
    replay = TraceReplay(placement, CostModel(block_bytes=1, tier_gbps=(1.0,)))
    reqs = [TraceRequest(i + 1, float(i), 512 * len(ids), 0, tuple(ids))
            for i, ids in enumerate(requests)]
    hits = []
    for req, nu in zip(reqs, next_uses(reqs)):
        hits.append(len(replay.run_request([block_key(h) for h in req.hash_ids],
                                           req.block_tokens(), nu)))
    return hits


@pytest.mark.parametrize("policy", ["lru", "opt"])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("capacity", [3, 5, 9])
def test_policy_matches_reference_hit_for_hit(policy, seed, capacity):
    requests = random_trace(seed)
    expected = reference(requests, capacity, policy)
    assert replay_hits(requests, capacity, policy) == expected
    assert sum(expected) > 0  # the traces do exercise hits


@pytest.mark.parametrize("seed", range(6))
def test_opt_is_an_upper_bound_of_lru(seed):
    requests = random_trace(seed, n=200)
    for capacity in (3, 6):
        opt, lru = reference(requests, capacity, "opt"), reference(requests, capacity, "lru")
        assert sum(opt) >= sum(lru)
