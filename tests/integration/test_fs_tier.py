"""The fs cluster tier's own guarantees, on a shared directory: a reader
never sees a half-written block, capacity is kept without scanning the
tree, a restarted or other node finds the blocks (and removes only stale
temporary files), and files of the earlier layout are neither read nor
removed. What every cluster tier shares is in test_cluster_tiers.py."""
from __future__ import annotations

import os
import threading
import time

from cluster_backends import SIZE, FsBackend
from cluster_servers import blocks

from ucm.adapters import framing
from ucm.adapters.base import Status

OK, NOT_FOUND, NO_SPACE = Status.OK, Status.NOT_FOUND, Status.NO_SPACE


def test_fs_readers_never_see_half_written_blocks(tmp_path):
    backend = FsBackend(str(tmp_path / "shared"))
    try:
        writer, reader = backend.make(), backend.make()
        big = 4 << 20
        keys, data = blocks(17, 12, big)
        done, first_pass = threading.Event(), threading.Event()
        seen: list[Status] = []

        def read_loop():
            # A pass before the first write and one after the last, whatever the
            # scheduler does, and as many as it allows while the writes go on.
            out = [bytearray(big) for _ in keys]
            while True:
                last = done.is_set()
                st = reader.get(keys, out)
                for s, o, d in zip(st, out, data):
                    seen.append(s)
                    assert s in (OK, NOT_FOUND), s
                    if s is OK:
                        assert bytes(o) == d
                first_pass.set()
                if last:
                    return

        t = threading.Thread(target=read_loop)
        t.start()
        assert first_pass.wait(30)
        for i in range(12):
            assert writer.put(keys[i:i + 1], data[i:i + 1]) == [OK]
        done.set()
        t.join()
        assert seen[:12] == [NOT_FOUND] * 12 and seen[-12:] == [OK] * 12
        leftovers = [f for _, _, files in os.walk(backend.path) for f in files if f.endswith(".tmp")]
        assert leftovers == []
    finally:
        backend.close()


def test_fs_capacity_is_enforced_without_scanning(tmp_path, monkeypatch):
    backend = FsBackend(str(tmp_path / "shared"))
    try:
        slot = SIZE + framing.chunked_header_bytes(SIZE)  # header, chunk table, payload
        a = backend.make(capacity=10 * slot)
        refuse = backend.make(capacity=10 * slot, key_prefix="refusing", on_full="refuse")

        def no_scan(*args, **kw):
            raise AssertionError("a write scanned the tree")

        monkeypatch.setattr(os, "walk", no_scan)
        monkeypatch.setattr(os, "scandir", no_scan)
        monkeypatch.setattr(os, "listdir", no_scan)
        keys, data = blocks(18, 25, SIZE)
        for i in range(0, 25, 5):
            assert a.put(keys[i:i + 5], data[i:i + 5]) == [OK] * 5
            assert a.used_bytes <= 10 * slot
        dropped = a.drain_dropped()
        assert dropped == keys[:15]  # least recently used first
        assert a.contains(keys) == [False] * 15 + [True] * 10
        assert refuse.put(keys[:12], data[:12]) == [OK] * 10 + [NO_SPACE] * 2
        assert refuse.drain_dropped() == []
    finally:
        monkeypatch.undo()
        backend.close()


def test_fs_restart_and_other_nodes(tmp_path):
    backend = FsBackend(str(tmp_path / "shared"))
    try:
        a = backend.make()
        keys, data = blocks(19, 4, SIZE)
        a.put(keys, data)
        shard = os.path.dirname(a.path_of(keys[0]))
        stale = os.path.join(shard, ".deadbeef.otherhost.1.0.tmp")
        fresh = os.path.join(shard, ".cafe.otherhost.1.1.tmp")
        for p in (stale, fresh):
            with open(p, "wb") as f:
                f.write(b"partial")
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
        b = backend.make()  # a restarted (or another) node: one scan at start
        assert sorted(b.iter_keys()) == sorted(keys)
        assert b.used_bytes == 4 * (SIZE + framing.chunked_header_bytes(SIZE)) == 4 * b.footprint_bytes(SIZE)
        assert not os.path.exists(stale) and os.path.exists(fresh)
        assert b.delete(keys[:1]) == [True]
        assert a.get(keys[:1], [bytearray(SIZE)]) == [NOT_FOUND]  # deleted by the other node
        assert a.drain_dropped() == keys[:1]
        a.rescan()
        assert sorted(a.iter_keys()) == sorted(keys[1:])
    finally:
        backend.close()


def test_fs_files_of_the_earlier_layout_are_neither_read_nor_removed(tmp_path):
    backend = FsBackend(str(tmp_path / "shared"))
    try:
        a = backend.make()
        keys, data = blocks(23, 2, SIZE)
        old = a.path_of(keys[0])[:-len(".v2")]  # `<32 hex>`, one checksum per file
        os.makedirs(os.path.dirname(old), exist_ok=True)
        with open(old, "wb") as f:
            f.write(framing.pack_header(keys[0], data[0]) + data[0])
        b = backend.make()  # its scan at start does not index it
        assert list(b.iter_keys()) == [] and b.contains(keys[:1]) == [False]
        assert b.get(keys[:1], [bytearray(SIZE)]) == [NOT_FOUND]
        assert b.get_range(keys[:1], [0], [bytearray(10)]) == [NOT_FOUND]
        assert b.put(keys, data) == [OK, OK]  # the new layout beside it
        out = [bytearray(SIZE), bytearray(SIZE)]
        assert b.get(keys, out) == [OK, OK] and [bytes(o) for o in out] == data
        assert os.path.exists(old)
    finally:
        backend.close()
