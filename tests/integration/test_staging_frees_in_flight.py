"""A reader's staging copy into DRAM while a demotion planned by another
thread (the headroom thread) is still moving its victim out: UnifiedCache
over the real dram and nvme adapters.

Placement counts the victim's room as soon as the demotion is planned, but
the arena slot is free only once the MOVE ran. A staging planned in between
finds room by bytes, plans no eviction of its own, and its COPY finds no
slot (NO_SPACE). It must be retried once the demotion's free landed, not
taken back as a miss, although by the time the failure is reconciled the
arena has a free slot again and names no victim.

The race is injected: the victim's NVMe write blocks until the staging's
COPY has failed, and lands before that failure is reconciled (the timing
that lost 1-4 blocks in about one round in three of a chunked read_slots
after the DRAM tier filled with fillers)."""
import hashlib
import threading

from ucm.cache.unified import Outcome, UnifiedCache

KiB = 1024
SIZE = 160 * KiB  # a slot of two 128 KiB extents: a unit of one block, a footprint of 256 KiB
DRAM_BLOCKS = 4   # 1 MiB of DRAM: 8 extents of 128 KiB


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": "1MiB"},
                      {"adapter": "nvme", "capacity": "16MiB",
                       "options": {"path": nvme_dir, "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def block(tag, i):
    key = hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()
    return key, hashlib.shake_128(key).digest(SIZE)


def read(c, keys):
    out = [bytearray(SIZE) for _ in keys]

    def fill(first, slots, arena):
        m = memoryview(arena)
        for i, sl in enumerate(slots):
            if sl is not None:
                out[first + i][:] = m[sl[0]:sl[0] + sl[1]]

    return c.read_slots(keys, [SIZE] * len(keys), fill), [bytes(o) for o in out]


def demote_one_blocked(c, victim):
    """Plans one headroom demotion (as `_reclaim_step` does) on a thread whose
    NVMe write of `victim` waits for `go`, started and blocked there; returns
    (thread, go)."""
    nvme = c.adapters[1]
    entered, go = threading.Event(), threading.Event()
    put = nvme.put_with_parents

    def blocking_put(keys, srcs, parents):
        if victim in keys:
            entered.set()
            assert go.wait(30)
        return put(keys, srcs, parents)

    nvme.put_with_parents = blocking_put

    def demote():
        with c.core.meta:
            plan = c.placement.reclaim(0, c.core.footprint(SIZE), max_victims=1)
            ticket = c.plans.admit(plan)
        c.plans.run(ticket, {})

    t = threading.Thread(target=demote)
    t.start()
    assert entered.wait(30)
    return t, go


def test_staging_retries_after_a_demotion_in_flight_frees_its_slot(nvme_dir):
    with UnifiedCache(cfg(nvme_dir)) as c:
        for r in range(3):
            doc, want = block(f"doc{r}", 0)
            assert c.store([doc], [want]).wait(30) == [Outcome.DONE]
            fillers = [block(f"fill{r}", i) for i in range(DRAM_BLOCKS)]
            for k, d in fillers:  # fill DRAM: the doc is demoted to NVMe
                assert c.store([k], [d]).wait(30) == [Outcome.DONE]
            assert c.locate([doc]) == ["nvme"]
            assert c.locate([k for k, _ in fillers]) == ["dram"] * DRAM_BLOCKS

            mover, go = demote_one_blocked(c, fillers[0][0])  # LRU: the oldest filler
            reconcile = c.plans.reconcile  # the executor's, called by its run
            seen = []

            def reconcile_after_the_free(failures, retried):
                if not go.is_set():  # the COPY failed while the MOVE was in flight; it lands now
                    seen.extend(f.status.name for f in failures)
                    go.set()
                    mover.join(30)
                return reconcile(failures, retried)

            c.plans.reconcile = reconcile_after_the_free
            try:
                outcomes, got = read(c, [doc])
            finally:
                go.set()
                mover.join(30)
                c.plans.reconcile = reconcile
                del c.adapters[1].put_with_parents
            assert seen == ["NO_SPACE"]  # the race did happen
            assert outcomes == [Outcome.DONE]
            assert got == [want]
            assert c.locate([doc, fillers[0][0]]) == ["dram", "nvme"]
        assert c.stats()["missing_blocks"] == 0


def test_staging_waits_for_a_demotion_still_in_flight_instead_of_evicting_more(nvme_dir):
    """The same race, but the demotion is still writing when the failure is
    reconciled: the staging waits for that free (released here only once
    it waits) and evicts nothing more than the demotion did."""
    with UnifiedCache(cfg(nvme_dir)) as c:
        doc, want = block("doc", 0)
        assert c.store([doc], [want]).wait(30) == [Outcome.DONE]
        fillers = [block("fill", i) for i in range(DRAM_BLOCKS)]
        for k, d in fillers:
            assert c.store([k], [d]).wait(30) == [Outcome.DONE]
        assert c.locate([doc]) == ["nvme"]
        before = c.stats()["slot_evictions"]

        mover, go = demote_one_blocked(c, fillers[0][0])
        order = c.tiers._order
        wait_frees = order.wait_frees

        def wait_and_release(t, seq, timeout_s):
            go.set()  # the demotion lands only while the staging waits for it
            return wait_frees(t, seq, timeout_s)

        order.wait_frees = wait_and_release
        try:
            outcomes, got = read(c, [doc])
        finally:
            go.set()
            mover.join(30)
            del order.wait_frees
            del c.adapters[1].put_with_parents
        assert outcomes == [Outcome.DONE]
        assert got == [want]
        assert c.stats()["slot_evictions"] == before  # no block evicted besides the demotion's
        assert c.locate([k for k, _ in fillers]) == ["nvme"] + ["dram"] * (DRAM_BLOCKS - 1)
