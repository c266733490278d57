"""ucm's blocks as KV events (ucm.connectors.kv_events.TierEventReader
over the block catalog of a real cache and of `ucm serve`): a block's
medium follows it through DRAM -> NVMe -> back -> removal, chains link,
another namespace's blocks are never advertised, a shared service's
blocks reach every engine's reader, and a killed and restarted service
produces removals, never stale claims."""
import hashlib
import signal

import numpy as np
import pytest
import yaml

from support import start_service
from ucm.api import Outcome
from ucm.cache.unified import UnifiedCache
from ucm.connectors.kv_events import Removed, Stored, TierEventReader
from ucm.keys import block_keys
from ucm.service import CacheClient

BT = 16  # tokens per block
PAGE = 8  # tokens per engine page
SIZE = 64 * 1024
SEED = hashlib.blake2b(b"namespace", digest_size=16).digest()


def hash_pages(parent, tokens, extra, first):
    out = []
    for j in range(0, len(tokens), PAGE):
        parent = hashlib.sha256((parent or b"none") + tokens[j:j + PAGE].tobytes()).digest()
        out.append(parent)
    return out


def reader(cache, seed=SEED):
    return TierEventReader(cache, lambda extra: seed, BT, hash_pages, threaded=False)


def prompt(n_blocks, salt):
    rng = np.random.default_rng(salt)
    toks = rng.integers(1000, 40000, size=n_blocks * BT, dtype=np.uint32)
    return toks, block_keys(SEED, toks, BT)


def describe(r, toks, keys, first=0, end=None):
    """Describes blocks first..end of the prompt."""
    r.describe([[keys[i], keys[i - 1] if i else None, toks[i * BT:(i + 1) * BT].astype("<u4").tobytes(), None]
                for i in range(first, len(keys) if end is None else end)])


def state(records):
    """What a consumer believes after `records`: page hash -> medium."""
    seen = {}
    for r in records:
        for h in r.hashes:
            if isinstance(r, Removed):
                assert seen.get(h) == r.medium, "a removal of what was never stored"
                del seen[h]
            else:
                seen[h] = r.medium
    return seen


def truth(cache, keys, recs):
    """What the consumer should believe: each block's pages with the medium of its tier now."""
    want = {"dram": "CPU_TIER1", "nvme": "DISK"}
    return {h: want[t] for t, x in zip(cache.locate(keys), recs) for h in x.hashes}


def cache_cfg(nvme_dir):
    return {"block_tokens": BT, "policy": {"name": "lru"},
            "tiers": [{"adapter": "dram", "capacity": "1MiB"},
                      {"adapter": "nvme", "capacity": "8MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB"}}]}


def test_the_medium_follows_a_block_from_dram_to_nvme_back_and_out(nvme_dir):
    with UnifiedCache(cache_cfg(nvme_dir)) as c:
        c.catalog.min_sweep_s, c.catalog.sweep_share = 0, 1.0
        r = reader(c)
        toks, keys = prompt(40, 1)  # 40 x 64 KiB > 1 MiB of DRAM: the first ones go down to NVMe
        describe(r, toks, keys)
        r.poll()
        assert c.store(keys, [np.full(SIZE, i, np.uint8) for i in range(40)]).wait(30) == [Outcome.DONE] * 40
        r.poll()
        recs = r.take()
        assert all(isinstance(x, Stored) for x in recs) and len(recs) == 40
        want = {"dram": "CPU_TIER1", "nvme": "DISK"}
        where = c.locate(keys)
        assert {"dram", "nvme"} <= set(where)
        # One record per block, parents first, with this engine's page hashes chained from the root.
        parent = None
        for i, x in enumerate(recs):
            assert x.parent_hash == parent
            assert x.hashes == hash_pages(parent, toks[i * BT:(i + 1) * BT], None, i == 0)
            assert list(x.tokens) == list(toks[i * BT:(i + 1) * BT])
            assert x.medium == want[where[i]]
            parent = x.hashes[-1]
        assert state(recs) == truth(c, keys, recs)
        # Staged back up: a move is a removal from DISK and a store with CPU_TIER1 (and the
        # blocks the staging pushed down from DRAM move the other way).
        down = [k for k, t in zip(keys, where) if t == "nvme"][:4]
        assert c.prefetch(down).wait(30) == [Outcome.DONE] * 4
        r.poll()
        moved = r.take()
        n = len(moved) // 2
        assert n >= 4 and all(isinstance(x, Removed) for x in moved[:n]) and all(isinstance(x, Stored) for x in moved[n:])
        up = {h for x in moved[n:] if x.medium == "CPU_TIER1" for h in x.hashes}
        assert {h for i, k in enumerate(keys) if k in down for h in recs[i].hashes} <= up
        told = state(recs + moved)
        assert told == truth(c, keys, recs)
        # Pushed out of every tier by other blocks (never described): removals for all 40.
        other, okeys = prompt(200, 2)
        for i in range(0, 200, 20):
            c.store(okeys[i:i + 20], [np.zeros(SIZE, np.uint8)] * 20).wait(30)
        r.poll()
        gone = r.take()
        assert c.lookup(keys[:1]) == 0
        assert gone and all(isinstance(x, Removed) for x in gone)
        assert state(recs + moved + gone) == {} and told
        assert r.take() == []


def test_another_namespaces_blocks_and_orphans_are_not_advertised(nvme_dir):
    with UnifiedCache(cache_cfg(nvme_dir)) as c:
        c.catalog.min_sweep_s, c.catalog.sweep_share = 0, 1.0
        mine, theirs = reader(c), reader(c, seed=bytes(16))
        toks, keys = prompt(3, 3)
        describe(mine, toks, keys, first=1)  # the first block's description comes later
        mine.poll()
        c.store(keys, [np.zeros(SIZE, np.uint8)] * 3).wait(30)
        mine.poll()
        assert mine.take() == []  # block 1's parent is not advertised: it waits
        describe(mine, toks, keys, end=1)
        mine.poll()
        assert [len(x.hashes) for x in mine.take()] == [2, 2, 2]  # the orphans follow their parent
        theirs.poll()
        assert theirs.take() == [] and theirs.counts["foreign"] == 1  # the root's key is not theirs


@pytest.fixture
def service(tmp_path):
    yield from serve(tmp_path, {})


@pytest.fixture
def logged_service(tmp_path):
    yield from serve(tmp_path, {"events": {"path": str(tmp_path / "events" / "catalog.log")}})


def serve(tmp_path, extra):
    sock = str(tmp_path / "ucm.sock")
    cfg = {**cache_cfg(str(tmp_path / "nvme")), "service": {"socket": sock}, **extra}
    (tmp_path / "nvme").mkdir()
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs = [start_service(str(path), sock)]
    yield str(path), sock, procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def to_nvme(client, keys):
    """Pushes the blocks of `keys` out of the 1 MiB DRAM tier (write-back to NVMe) with 24 others."""
    _, more = prompt(24, 99)
    assert client.store(more, [np.full(SIZE, 8, np.uint8)] * 24).wait(30) == [Outcome.DONE] * 24
    assert client.flush()
    assert client.locate(keys) == ["nvme"] * len(keys)


def stored_on_nvme_then_restarted(served, a, b, salt, never_stored=None):
    """Engine A describes (also `never_stored`, a prompt it never stores) and
    stores a prompt of 6 blocks, which engine B advertises; the blocks go to
    NVMe, the service is killed (SIGKILL: no clean close), B withdraws every
    claim, and the service is restarted with the blocks recovered from NVMe.
    Returns A's and B's readers, the prompt's tokens and keys, and B's
    first events."""
    import time
    path, sock, procs = served
    ra, rb = reader(a), reader(b)
    toks, keys = prompt(6, salt)
    describe(ra, toks, keys)
    if never_stored is not None:
        describe(ra, *never_stored)
    ra.poll()
    assert a.store(keys, [np.full(SIZE, 7, np.uint8)] * 6).wait(30) == [Outcome.DONE] * 6
    time.sleep(0.1)  # the catalog sweeps at most every 50 ms
    rb.poll()
    got = rb.take()  # engine B advertises A's blocks, with its own hashes of the tokens
    assert [x.medium for x in got] == ["CPU_TIER1"] * 6
    assert got[0].hashes == hash_pages(None, toks[:BT], None, True)
    to_nvme(a, keys)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    rb.poll()  # the service is gone: every claim is withdrawn
    assert state(got + rb.take()) == {} and rb.counts["unreachable"] >= 1
    procs.append(start_service(path, sock))
    deadline = time.time() + 10
    while b.lookup(keys) < 6 and time.time() < deadline:  # the NVMe tier recovers its blocks
        time.sleep(0.1)
    return ra, rb, toks, keys, got


def test_a_shared_service_advertises_to_every_engine_and_a_restart_never_leaves_stale_claims(service):
    import time
    a, b = CacheClient(service[1]), CacheClient(service[1])
    try:
        ra, rb, toks, keys, got = stored_on_nvme_then_restarted(service, a, b, 4)
        rb.poll()  # a new instance: its journal starts over; nothing it has not described is claimed
        assert rb.take() == [] and rb.counts["resets"] >= 2
        describe(ra, toks, keys)  # an engine stores them again: advertised again, from the NVMe copies
        ra.poll()
        assert a.store(keys, [np.full(SIZE, 7, np.uint8)] * 6).wait(30) == [Outcome.DONE] * 6
        time.sleep(0.1)
        rb.poll()
        again = rb.take()
        assert len(again) == 6 and [x.hashes for x in again] == [x.hashes for x in got]
    finally:
        a.close()
        b.close()


def test_with_events_path_a_restarted_service_advertises_what_nvme_kept_without_a_new_store(logged_service):
    import time
    a, b = CacheClient(logged_service[1]), CacheClient(logged_service[1])
    try:
        _, rb, _, keys, got = stored_on_nvme_then_restarted(logged_service, a, b, 5, never_stored=prompt(2, 6))
        assert b.stats()["catalog"]["restored"] == 8
        again, deadline = [], time.time() + 10
        while len(again) < 6 and time.time() < deadline:  # no engine described anything since
            time.sleep(0.1)
            rb.poll()
            again += rb.take()
        assert [x.hashes for x in again] == [x.hashes for x in got]  # the same pages, the same hashes
        assert state(again) == truth(b, keys, again) and set(state(again).values()) == {"DISK"}
        time.sleep(0.3)
        rb.poll()
        assert rb.take() == []  # the two blocks never stored are never claimed
    finally:
        a.close()
        b.close()


class SlowCatalog:
    """A cache whose `events` hangs until released (a service under load)."""

    def __init__(self):
        import threading
        self.release = threading.Event()
        self.calls = 0
        self.returned = False

    def describe(self, blocks):
        pass

    def events(self, since, epoch, limit=256):
        self.calls += 1
        self.release.wait(30)
        self.returned = True
        return {"epoch": 1, "next": 0, "events": [], "reset": epoch != 1}

    def holdings(self, offset, limit=256):
        return {"blocks": [], "next_offset": 0, "done": True}


def test_a_slow_cache_never_blocks_the_engines_take():
    import time

    slow = SlowCatalog()
    r = TierEventReader(slow, lambda extra: SEED, BT, hash_pages, poll_s=0.01)
    try:
        assert r.take() == []  # starts the poll thread, which hangs in `events`
        deadline = time.monotonic() + 5
        while slow.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(100):
            assert r.take() == []
        assert slow.calls == 1 and not slow.returned  # the engine's takes went on while the poll waited
    finally:
        slow.release.set()
        r.close()
