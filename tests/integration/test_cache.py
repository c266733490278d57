"""UnifiedCache over the real dram and nvme adapters, real files, real processes."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ucm import _native
from ucm.adapters.faults import FaultyAdapter, FaultyDevice
from ucm.adapters.nvme import NvmeAdapter
from support import chain
from ucm.cache.unified import Outcome, UnifiedCache
from ucm.errors import ArgumentError, ConfigError

SIZE = 64 * 1024


def cfg(nvme_dir, dram="1MiB", nvme="16MiB", policy="lru", landing="dram", tiers=("dram", "nvme"), headroom=0.0,
        **nv):
    t = []
    if "dram" in tiers:
        t.append({"adapter": "dram", "capacity": dram, "headroom": headroom})
    if "nvme" in tiers:
        t.append({"adapter": "nvme", "capacity": nvme,
                  "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB", **nv}})
    return {"tiers": t, "landing_tier": landing, "policy": {"name": policy}}


def load_all(cache, keys):
    out = [bytearray(SIZE) for _ in keys]
    res = cache.load(keys, out).wait(30)
    return res, [bytes(o) for o in out]


def test_round_trip_demotion_and_promotion(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        keys, data = chain(40, 1)  # 40 x 64 KiB > 1 MiB of DRAM: the prefix is demoted to NVMe
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 40
        where = c.locate(keys)
        assert set(where) == {"dram", "nvme"}
        assert c.lookup(keys) == 40
        res, out = load_all(c, keys)
        assert res == [Outcome.DONE] * 40 and out == data
        s = c.stats()
        assert s["tiers"]["nvme"]["demotions_in"] > 0 and s["tiers"]["dram"]["promotions_in"] > 0
        # Promotion copies up: blocks that were only on NVMe are in DRAM now.
        after = c.locate(keys)
        assert any(a == "dram" for w, a in zip(where, after) if w == "nvme")
        assert None not in after


def test_lookup_is_the_exact_longest_prefix(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        keys, data = chain(8, 2)
        c.store(keys[:5], data[:5]).wait(30)
        assert c.lookup(keys) == 5
        assert c.lookup(keys[:3]) == 3
        assert c.lookup([os.urandom(16)] + keys) == 0
        other, _ = chain(4, 3)
        assert c.lookup(other) == 0
        assert c.lookup([]) == 0
        # A child without its stored parent is refused (useless without its prefix).
        res = c.store(keys[6:7], data[6:7], parent=keys[5]).wait(30)
        assert res == [Outcome.MISSING] and c.lookup(keys) == 5


def test_capacity_pins_and_parents(nvme_dir):
    with UnifiedCache(cfg(nvme_dir, dram="512KiB", nvme="4MiB")) as c:
        pinned, pdata = chain(3, 10)
        c.store(pinned, pdata).wait(30)
        c.pin(pinned)
        for s in range(11, 40):
            k, d = chain(6, s)
            c.store(k, d).wait(30)
            st = c.stats()["tiers"]
            for name, t in st.items():
                assert t["used_bytes"] <= t["capacity_bytes"], name
                assert t["adapter"].get("blocks", 0) <= t["blocks"] + 1 or name == "nvme"
            # Never a child without its parent, in any tier.
            loc = c.locate(k)
            assert all(loc[i] is None or loc[i - 1] is not None for i in range(1, len(k)))
        assert c.lookup(pinned) == 3
        res, out = load_all(c, pinned)
        assert res == [Outcome.DONE] * 3 and out == pdata
        c.unpin(pinned)


def test_restart_serves_every_sealed_block(nvme_dir):
    keys, data = chain(30, 4)
    with UnifiedCache(cfg(nvme_dir, tiers=("nvme",), landing="nvme", nvme="32MiB")) as c:
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 30
        assert c.flush()
    with UnifiedCache(cfg(nvme_dir, tiers=("nvme",), landing="nvme", nvme="32MiB")) as c:
        assert c.lookup(keys) == 30
        res, out = load_all(c, keys)
        assert res == [Outcome.DONE] * 30 and out == data


def test_restart_two_tiers_keeps_what_reached_nvme(nvme_dir):
    keys, data = chain(40, 5)
    with UnifiedCache(cfg(nvme_dir)) as c:
        c.store(keys, data).wait(30)
        on_nvme = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"]
        assert on_nvme
        c.flush()
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.locate(on_nvme) == ["nvme"] * len(on_nvme)
        out = [bytearray(SIZE) for _ in on_nvme]
        assert c.load(on_nvme, out).wait(30) == [Outcome.DONE] * len(on_nvme)
        expect = dict(zip(keys, data))
        assert [bytes(o) for o in out] == [expect[k] for k in on_nvme]


def test_flipped_byte_is_a_miss_and_counted(nvme_dir):
    keys, data = chain(6, 6)
    conf = cfg(nvme_dir, tiers=("nvme",), landing="nvme")
    with UnifiedCache(conf) as c:
        c.store(keys, data).wait(30)
        c.flush()
    path = os.path.join(nvme_dir, "ucm-regions.dat")
    raw = bytearray(open(path, "rb").read())
    pos = raw.find(data[3][:4096]) + 1000
    assert pos > 1000
    raw[pos] ^= 0x01
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos]]))
    with UnifiedCache(conf) as c:
        res, out = load_all(c, keys)
        assert res[3] is Outcome.CORRUPT
        assert [r for i, r in enumerate(res) if i != 3] == [Outcome.DONE] * 5
        assert [o for i, o in enumerate(out) if i != 3] == [d for i, d in enumerate(data) if i != 3]
        assert c.stats()["corrupt"] == 1
        assert c.lookup(keys) == 3  # the bad block and its descendants are gone


WRITER = textwrap.dedent("""
    import sys, hashlib
    sys.path.insert(0, {root!r})
    from ucm.cache.unified import UnifiedCache
    conf = {conf!r}
    c = UnifiedCache(conf)
    prev = None
    i = 0
    while True:
        key = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()
        blob = hashlib.shake_128(key).digest({size})
        c.store([key], [blob], parent=None).wait(30)
        i += 1
        if i % 8 == 0:
            print(i, flush=True)
""")


def test_sigkill_mid_write_leaves_intact_or_missing(nvme_dir):
    import hashlib
    conf = cfg(nvme_dir, tiers=("nvme",), landing="nvme", nvme="64MiB")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root, conf=conf, size=SIZE)],
                            stdout=subprocess.PIPE, text=True)
    seen = 0
    deadline = time.time() + 60
    while seen < 200 and time.time() < deadline:  # several regions sealed, one in flight
        line = proc.stdout.readline()
        if not line:
            break
        seen = int(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert seen >= 200
    with UnifiedCache(conf) as c:
        keys = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(seen + 64)]
        out = [bytearray(SIZE) for _ in keys]
        res = c.load(keys, out).wait(60)
        served = 0
        for k, r, o in zip(keys, res, out):
            assert r in (Outcome.DONE, Outcome.MISSING)
            if r is Outcome.DONE:
                assert bytes(o) == hashlib.shake_128(k).digest(SIZE)
                served += 1
        assert served >= 100  # sealed regions survived the kill


def _disk_full_checks(c, keys, data):
    res = c.store(keys, data).wait(30)  # more than DRAM holds: demotions hit the full disk
    assert Outcome.DONE in res
    c.flush(timeout_s=10)
    more, mdata = chain(10, 99)
    res = c.store(more, mdata).wait(30)
    assert all(r in (Outcome.DONE, Outcome.MISSING) for r in res)
    served = [k for k, t in zip(more, c.locate(more)) if t == "dram"]
    assert served, "DRAM keeps serving while the disk is full"
    out = [bytearray(SIZE) for _ in served]
    assert c.load(served, out).wait(30) == [Outcome.DONE] * len(served)
    expect = dict(zip(more, mdata))
    assert [bytes(o) for o in out] == [expect[k] for k in served]
    st = c.stats()
    assert st["tiers"]["nvme"]["adapter"]["write_errors"] >= 1


def _with_device(device):
    """A tier factory that builds the nvme tier on `device`."""
    def make(index, cls, capacity, options):
        if cls is NvmeAdapter:
            return cls(capacity_bytes=capacity, config=options, device=device)
        return cls(capacity_bytes=capacity, config=options)
    return make


def _faulty_nvme(index, cls, capacity, options):
    """A tier factory that wraps the nvme tier in a FaultyAdapter."""
    a = cls(capacity_bytes=capacity, config=options)
    return FaultyAdapter(a) if cls is NvmeAdapter else a


def test_disk_full_injected(nvme_dir):
    device = FaultyDevice(_native.IoEngine(2))
    device.fail_writes(errno.ENOSPC)  # every write, from the start
    with UnifiedCache(cfg(nvme_dir, retry_after_s=0.0), tier_factory=_with_device(device)) as c:
        keys, data = chain(40, 7)
        _disk_full_checks(c, keys, data)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (skips where mounting is not allowed)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_real_tmpfs(small_tmpfs):
    with UnifiedCache(cfg(str(small_tmpfs), nvme="8MiB", retry_after_s=0.0)) as c:
        keys, data = chain(60, 8)
        _disk_full_checks(c, keys, data)


def test_dram_arena_larger_than_its_tmpfs_is_a_clear_error(small_tmpfs):
    """A container's small /dev/shm: an error at start naming the fix, not a
    SIGBUS when a copy first writes past what the tmpfs holds."""
    from ucm.adapters.base import Status
    from ucm.adapters.dram import DramAdapter, DramConfig
    from ucm.errors import AdapterError

    for prefault in (True, False):
        with pytest.raises(AdapterError, match=r"capacity.*--shm-size"):
            DramAdapter(4 << 20, DramConfig(path=str(small_tmpfs), prefault=prefault))
        assert os.listdir(small_tmpfs) == []  # nothing left behind
    a = DramAdapter(512 << 10, DramConfig(path=str(small_tmpfs)))  # fits
    try:
        out = bytearray(4096)
        assert a.put([b"k" * 16], [b"x" * 4096]) == [Status.OK]
        assert a.get([b"k" * 16], [out]) == [Status.OK] and out == b"x" * 4096
    finally:
        a.close()


def test_bad_arguments_and_config(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        with pytest.raises(ArgumentError, match="16-byte"):
            c.store([b"short"], [b"x" * SIZE])
        with pytest.raises(ArgumentError, match="2 keys but 1 buffers"):
            c.load([os.urandom(16)] * 2, [bytearray(SIZE)])
        with pytest.raises(ArgumentError, match="writable"):
            c.load([os.urandom(16)], [bytes(SIZE)])
        with pytest.raises(ArgumentError, match="unknown tier 'ssd'"):
            c.prefetch([os.urandom(16)], tier="ssd")
        key = os.urandom(16)
        for call in (c.lookup, c.locate, c.pin, c.unpin, c.commit, c.abort, c.prefetch,
                     lambda k: c.finish(k, 1), lambda k: c.reserve(k, [SIZE] * 16), c.acquire):
            with pytest.raises(ArgumentError, match="wrap a single key in a list"):
                call(key)  # one key where a list belongs: an error, never a silent no-op
            with pytest.raises(ArgumentError, match="16-byte"):
                call([key, b"short"])
        for bad_count in (-1, 2.5, True, "12"):
            with pytest.raises(ArgumentError, match="output_tokens must be an integer >= 0"):
                c.finish([os.urandom(16)], bad_count)
    with pytest.raises(ConfigError, match="tiers.1.adapter: unknown adapter 'floppy'"):
        bad = cfg(nvme_dir)
        bad["tiers"][1]["adapter"] = "floppy"
        UnifiedCache(bad)
    with pytest.raises(ConfigError, match="tiers.0.capacity"):
        bad = cfg(nvme_dir)
        bad["tiers"][0]["capacity"] = "lots"
        UnifiedCache(bad)


def test_prefetch_stages_nvme_blocks_into_dram(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        keys, data = chain(40, 9)
        c.store(keys, data).wait(30)
        low = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"][:4]
        assert low
        assert c.prefetch(low).wait(30) == [Outcome.DONE] * len(low)
        assert c.locate(low) == ["dram"] * len(low)
        res, out = load_all(c, low)
        expect = dict(zip(keys, data))
        assert out == [expect[k] for k in low]


def test_acquire_stages_nvme_blocks_in_one_read(nvme_dir):
    """Blocks held only on NVMe are planned together and read in one batch;
    a block staged for this reader is never the victim of the next one's
    promotion, so when DRAM cannot hold them all the rest are misses."""
    with UnifiedCache(cfg(nvme_dir), tier_factory=_faulty_nvme) as c:
        keys, data = chain(40, 11)  # DRAM holds 16 of them
        c.store(keys, data).wait(30)
        c.flush()
        low = [i for i, t in enumerate(c.locate(keys)) if t == "nvme"][:12]
        assert len(low) == 12
        nvme = c.adapters[1]
        before = nvme.calls["get"]
        leases = c.acquire([keys[i] for i in low])
        try:
            assert [bytes(le.view) for le in leases] == [data[i] for i in low]
            assert nvme.calls["get"] - before == 1  # the twelve blocks in one batch
        finally:
            c.release(leases)
        assert c.locate([keys[i] for i in low]) == ["dram"] * 12
        # More NVMe blocks than DRAM holds: the first 16 staged, the rest not.
        more = [i for i, t in enumerate(c.locate(keys)) if t == "nvme"][:20]
        assert len(more) == 20
        leases = c.acquire([keys[i] for i in more])
        try:
            got = [le is not None for le in leases]
            assert sum(got) == 16
            assert all(bytes(le.view) == data[i] for le, i in zip(leases, more) if le is not None)
        finally:
            c.release(leases)
        assert c.lookup(keys) == 40  # nothing was lost on the way


def test_headroom_demotes_ahead_of_need(nvme_dir):
    with UnifiedCache(cfg(nvme_dir, headroom="25%")) as c:  # 1 MiB of DRAM keeps 256 KiB (4 blocks) free
        keys, data = chain(30, 12)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 30
        deadline = time.monotonic() + 10
        while c.stats()["tiers"]["dram"]["used_bytes"] > (1 << 20) - (256 << 10) and time.monotonic() < deadline:
            time.sleep(0.01)  # the background thread makes it
        assert c.stats()["tiers"]["dram"]["used_bytes"] <= (1 << 20) - (256 << 10)
        c.store(*chain(3, 13)).wait(30)
        assert c.flush()  # makes it too
        s = c.stats()["tiers"]
        assert s["dram"]["used_bytes"] <= (1 << 20) - (256 << 10)
        assert s["dram"]["used_bytes"] >= (1 << 20) - (256 << 10) - 4 * SIZE  # no more than needed
        assert 0 < c.stats()["headroom_evictions"] <= s["dram"]["evictions"]  # counted apart
        assert c.lookup(keys) == 30  # demoted, not dropped
        res, out = load_all(c, keys)
        assert res == [Outcome.DONE] * 30 and out == data


def test_a_failing_batch_read_is_a_miss_and_gives_the_slots_back(nvme_dir):
    with UnifiedCache(cfg(nvme_dir), tier_factory=_faulty_nvme) as c:
        keys, data = chain(40, 14)
        c.store(keys, data).wait(30)
        c.flush()
        low = [k for k, t in zip(keys, c.locate(keys)) if t == "nvme"][:6]
        nvme = c.adapters[1]
        nvme.raise_on("get", OSError("injected: the device went away"))
        assert c.acquire(low) == [None] * 6
        assert [c.adapters[0].slot_offset(k) for k in low] == [None] * 6  # no reservation left behind
        assert c.locate(low) == ["nvme"] * 6  # still cached below
        nvme.clear()
        leases = c.acquire(low)  # the same slots can be had again, and the blocks are intact
        try:
            expect = dict(zip(keys, data))
            assert [bytes(le.view) for le in leases] == [expect[k] for k in low]
        finally:
            c.release(leases)


def test_concurrent_readers_writers_and_the_headroom_thread_never_see_wrong_bytes(nvme_dir):
    """Stores, arena leases (staging from NVMe), copies out and prefetches on
    four threads while the background thread demotes for headroom: every
    block handed out is the one stored under its key."""
    import random
    import threading

    with UnifiedCache(cfg(nvme_dir, dram="1MiB", nvme="32MiB", headroom=0.25)) as c:
        chains = [chain(8, 100 + i) for i in range(12)]  # 96 blocks: DRAM holds 16
        expect = {k: d for keys, data in chains for k, d in zip(keys, data)}
        errors: list[str] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    keys, data = chains[rng.randrange(len(chains))]
                    n = rng.randint(1, len(keys))
                    op = rng.random()
                    if op < 0.35:
                        c.store(keys[:n], data[:n]).wait(30)
                    elif op < 0.7:
                        leases = c.acquire(keys[:n])
                        try:
                            for k, le in zip(keys, leases):
                                if le is not None and bytes(le.view) != expect[k]:
                                    errors.append("wrong bytes from acquire")
                        finally:
                            c.release(leases)
                    elif op < 0.9:
                        res, out = load_all(c, keys[:n])
                        for k, r, o in zip(keys, res, out):
                            if r is Outcome.DONE and o != expect[k]:
                                errors.append("wrong bytes from load")
                    else:
                        c.prefetch(keys[:n]).wait(30)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert c.flush()
        s = c.stats()["tiers"]
        assert s["dram"]["used_bytes"] <= (1 << 20) - (256 << 10)
        assert s["nvme"]["demotions_in"] > 0 and s["dram"]["promotions_in"] > 0
        for keys, data in chains:  # whatever is still cached reads back intact
            n = c.lookup(keys)
            res, out = load_all(c, keys[:n])
            assert res == [Outcome.DONE] * n and out == data[:n]


def test_heat_learns_what_a_store_continues(nvme_dir):
    """A store behind a cached prefix (a chat's next turn, a question after
    a template) tells the HeatTracker which block its first block follows,
    through `store` and through `reserve` (the vLLM connector's path)."""
    with UnifiedCache(cfg(nvme_dir, policy="heat", dram="4MiB")) as c:
        keys, data = chain(6, 7)
        assert c.store(keys[:3], data[:3]).wait(30) == [Outcome.DONE] * 3
        heat = c.placement.heat
        assert not any(heat.get(k).ext for k in keys[:3])  # a new prompt: nothing before it was known
        assert c.store(keys[3:4], data[3:4], parent=keys[2]).wait(30) == [Outcome.DONE]
        assert heat.get(keys[3]).ext and heat.get(keys[3]).parent == keys[2]
        slots = c.reserve(keys[4:6], [SIZE, SIZE], parent=keys[3])
        assert all(isinstance(s, memoryview) for s in slots)
        for s, d in zip(slots, data[4:6]):
            s[:] = d
        assert c.commit(keys[4:6]) == [True, True]
        assert heat.get(keys[4]).ext and not heat.get(keys[5]).ext  # keys[5] follows keys[4], new itself
        assert load_all(c, keys)[1] == data
        # The engine reports how long an answer the prompt got: a placement hint.
        c.finish(keys[:4], 900)
        assert [heat.get(k).long_out for k in keys] == [True] * 4 + [False] * 2
        assert c.stats()["finished_requests"] == 1


def test_a_block_larger_than_an_nvme_region_is_refused_there_and_leaves_no_slot_behind(tmp_path):
    """Demoting a block the lower tier cannot hold (bigger than a region) is
    a refused step: the block is dropped, its DRAM slot comes back, and the
    cache keeps storing (review of the service fuzzer's finding)."""
    conf = {"tiers": [{"adapter": "dram", "capacity": "4MiB", "options": {"path": str(tmp_path)}},
                      {"adapter": "nvme", "capacity": "32MiB",
                       "options": {"path": str(tmp_path / "nvme"), "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "policy": {"name": "lru"}}
    with UnifiedCache(conf) as c:
        big = [os.urandom(16) for _ in range(3)]
        for k in big:  # 2 MiB each: DRAM holds one at a time beside the rest, NVMe none
            assert c.store([k], [bytes(2 << 20)]).wait(30) == [Outcome.DONE]
        keys, data = chain(8, 31)
        for _ in range(3):
            assert c.store(keys, data).wait(30) == [Outcome.DONE] * 8
        st = c.stats()["tiers"]
        assert st["dram"]["blocks"] == st["dram"]["adapter"]["blocks"]  # no slot the placement forgot
        assert st["nvme"]["adapter"]["too_large"] >= 1
        res, out = load_all(c, keys)
        assert res == [Outcome.DONE] * 8 and out == data
        assert c.locate(big).count(None) >= 2  # the ones pushed out are gone, not half-kept


def test_a_pinned_hit_longer_than_dram_is_delivered_chunk_by_chunk(nvme_dir):
    """Issue 14 item 8 at the cache: an engine was promised (pinned) a hit
    of more blocks than DRAM holds, all of them on NVMe; its worker reads
    them one chunk at a time (acquire, copy, release). Every chunk stages:
    the room comes from the pinned copies staged before, which are still on
    NVMe; nothing promised is lost."""
    conf = cfg(nvme_dir)
    conf["tiers"][0]["capacity"] = "256KiB"  # four 64 KiB slots
    with UnifiedCache(conf) as c:
        keys, data = chain(6, 41)
        assert c.store(keys, data).wait(30) == [Outcome.DONE] * 6
        filler, fdata = chain(8, 42)
        c.store(filler, fdata).wait(30)
        c.flush()
        assert c.locate(keys) == ["nvme"] * 6
        c.pin(keys)
        try:
            for k, d in zip(keys, data):
                (lease,) = c.acquire([k])
                assert lease is not None and bytes(lease.view) == d
                c.release([lease])
            assert None not in c.locate(keys)
        finally:
            c.unpin(keys)
