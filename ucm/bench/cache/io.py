"""`ucm bench io`: tier bandwidth next to the baselines of the same run.

Measured in one process, one after the other:
- `memcpy_gbps`: single-thread memcpy of the same blocks into prefaulted memory;
- `dram_store_gbps` / `dram_load_gbps`: the dram adapter's put / get;
- `nvme_store_gbps`: the nvme adapter's put of every block (new keys each
  round) until the last region is sealed on the medium (O_DIRECT), into a
  region file laid out before timing (as fio lays out its file);
- `nvme_load_gbps`: get of every block by a freshly opened adapter (the
  index rebuilt from footers, so nothing is served from memory), batched
  `--batch` blocks per call, O_DIRECT (no page cache);
- `fio_write_gbps` / `fio_read_gbps`: fio on the same region file and the
  same bytes (`--size` of the blocks moved, from offset 0, where the
  adapter's low regions lie), O_DIRECT, sequential 1 MiB requests, iodepth
  `--io-threads` (as the adapter's requests in flight of `io_chunk` 1 MiB),
  when fio is installed.
  NVMe and fio are interleaved over `--repeats` rounds (ucm first in even
  rounds, fio first in odd ones, so neither always follows the other); each
  figure is the median of the rounds, `*_vs_fio` the median of the rounds'
  paired ratios, and `rounds` holds every round's figures. (fio's write
  overwrites the adapter's regions; before each of its rounds the adapter's
  region trailers are zeroed, untimed, so it starts on an empty medium and
  writes from offset 0.)
- `stage_gbps` / `stage_no_headroom_gbps`: a UnifiedCache (dram over nvme)
  staging NVMe-only blocks into the shared-memory arena with `acquire`,
  `--batch` blocks per call (a request's hit), timed; before each call,
  untimed, `--batch` new blocks are stored (so DRAM's victims are blocks
  that still have to be written to NVMe) and 0.1 s passes (the engine's
  forward). With headroom (20 % of DRAM) the victims are written in the
  background; without, each call writes them before reading.
GB/s are 10^9 bytes per second. On a terminal a progress bar goes to stderr.

With `--range`, instead: layer-wise range reads from nvme next to whole-block
reads, on one medium per chunk size (`--chunk-kb`, several allowed), written
once and read by a freshly opened adapter (O_DIRECT, nothing from memory).
Each block is `--layers` equal layer ranges (layer-major, so one layer of a
block is one contiguous range). Per chunk size: `whole_mbps` (get of every
block, `--batch` per call), `range_mbps` (one layer of every block, `--batch`
ranges per call, MB/s of layer bytes delivered), `range_amplification`
(medium bytes read per layer byte), `footer_bytes_per_block`, and p50 / p99
latency of single calls (`whole_p50_ms`, `range_p50_us`, ...). MB/s are
10^6 bytes per second.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

from ucm import _native
from ucm.adapters.base import Status
from ucm.adapters.dram import DramAdapter, DramConfig
from ucm.adapters.nvme import NvmeAdapter, NvmeConfig
from ucm.adapters.nvme import format as nvme_format
from ucm.bench import common
from ucm.progress import bar


def register(sub: common.Subparsers) -> None:
    common.add_bench(sub, "io", help="tier bandwidth vs memcpy and fio", description=__doc__, add_args=_add_args,
                     handler=run)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="directory for the NVMe tier and fio (default: a temp dir under /var/tmp)")
    p.add_argument("--size-mb", type=int, default=512, help="bytes moved per measurement, MiB (default 512)")
    p.add_argument("--block-kb", type=int, default=2880,
                   help="block size, KiB (default 2880: one 128-token block of SmolLM2-135M in bf16)")
    p.add_argument("--batch", type=int, default=16, help="blocks per nvme get call (default 16)")
    p.add_argument("--io-threads", type=int, default=16,
                   help="nvme native I/O threads, i.e. requests in flight (default 16, as fio's iodepth)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio baseline")
    p.add_argument("--repeats", type=int, default=None,
                   help="paired rounds (nvme with fio, or a cluster tier with its client); medians are "
                        "reported (default 5, a cluster tier 3)")
    common.add_json_flag(p)
    rng = p.add_argument_group("range reads", "with --range: one layer of each block from nvme vs whole blocks")
    rng.add_argument("--range", action="store_true", help="measure layer range reads instead")
    rng.add_argument("--layers", type=int, default=30, help="equal layer ranges per block (default 30)")
    rng.add_argument("--chunk-kb", type=int, action="append", default=None,
                     help="nvme chunk_bytes in KiB, one medium each (default 32 and 64)")
    cluster = p.add_argument_group("cluster tiers", "with --tier: the tier's adapter next to its raw client "
                                   "(ucm/bench/cache/cluster_io.py); see docs/operations.md")
    cluster.add_argument("--tier", choices=("mooncake", "redis", "fs"), default=None,
                         help="measure this cluster tier instead of dram/nvme")
    cluster.add_argument("--master", default=None, help="mooncake master host:port (default: start one on 127.0.0.1)")
    cluster.add_argument("--metadata-server", default=None, help="mooncake metadata server (default P2PHANDSHAKE)")
    cluster.add_argument("--pool", choices=("peer", "local", "none"), default=None,
                         help="mooncake pool: a started pool node, this process, or the cluster's")
    cluster.add_argument("--redis-url", default=None, help="redis URL (default: start a redis-server on 127.0.0.1)")


def _buffers(n: int, size: int) -> list[mmap.mmap]:
    out = []
    for _ in range(n):
        m = mmap.mmap(-1, size)
        _native.prefault(m)
        out.append(m)
    return out


def measure(directory: str, size_mb: int, block_bytes: int, batch: int, io_threads: int,
            fio: bool, repeats: int = 5) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    n = max(1, (size_mb << 20) // block_bytes)
    total = n * block_bytes
    srcs = _buffers(n, block_bytes)
    for i, s in enumerate(srcs):
        s[:] = os.urandom(4096) * (block_bytes // 4096) + os.urandom(block_bytes % 4096)
    dsts = _buffers(n, block_bytes)
    keys = [os.urandom(16) for _ in range(n)]
    res: dict[str, Any] = {"block_bytes": block_bytes, "blocks": n, "bytes": total}

    t = time.perf_counter()
    for d, s in zip(dsts, srcs):
        _native.copy(d, s)
    res["memcpy_gbps"] = common.gbps(total, time.perf_counter() - t)

    # the arena hands space out in extents of whole slots: room for the blocks plus the rounding
    slot = (block_bytes + 4095) // 4096 * 4096
    dram = DramAdapter(capacity_bytes=n * slot * 5 // 4 + (64 << 20), config=DramConfig())
    try:
        t = time.perf_counter()
        st = dram.put(keys, srcs)
        res["dram_store_gbps"] = common.gbps(total, time.perf_counter() - t)
        t = time.perf_counter()
        st += dram.get(keys, dsts)
        res["dram_load_gbps"] = common.gbps(total, time.perf_counter() - t)
        res["dram_ok"] = all(s is Status.OK for s in st)
    finally:
        dram.close()

    use_fio = fio and shutil.which("fio") is not None
    steps = bar(total=repeats + 2, desc="bench io", unit="step")
    res.update(_nvme_rounds(directory, srcs, dsts, batch, io_threads, repeats, use_fio, steps))
    for headroom, key in ((0.2, "stage"), (0.0, "stage_no_headroom")):
        steps.set_postfix_str(f"staging through the cache, headroom {headroom:.0%}")
        gbps, ok = _stage(directory, srcs, keys, batch, io_threads, headroom)
        res[f"{key}_gbps"] = gbps
        res["stage_ok"] = ok and res.get("stage_ok", True)
        steps.update(1)
    steps.close()

    if res.get("fio_read_gbps"):
        res["stage_vs_fio_read"] = round(res["stage_gbps"] / res["fio_read_gbps"], 3)
        res["stage_no_headroom_vs_fio_read"] = round(res["stage_no_headroom_gbps"] / res["fio_read_gbps"], 3)
    res["dram_store_vs_memcpy"] = round(res["dram_store_gbps"] / res["memcpy_gbps"], 3)
    res["dram_load_vs_memcpy"] = round(res["dram_load_gbps"] / res["memcpy_gbps"], 3)
    return res


def _nvme_rounds(directory: str, srcs: list, dsts: list, batch: int, io_threads: int, repeats: int,
                 fio: bool, steps: Any) -> dict[str, Any]:
    """The nvme adapter and fio, interleaved on one region file (see the
    module doc): medians of the rounds, and every round under `rounds`."""
    n, block_bytes = len(srcs), len(srcs[0])
    total = n * block_bytes
    work = tempfile.mkdtemp(prefix="ucm-bench-io-", dir=directory)
    region = 64 << 20
    while region < 2 * block_bytes:
        region *= 2
    cfg = NvmeConfig(path=work, region_size=region, io_threads=io_threads, io_chunk=1 << 20, write_buffers=4)
    cap = (total * 2 // region + 4) * region
    path = os.path.join(work, "ucm-regions.dat")
    fio_bytes = max(1 << 20, total // (1 << 20) * (1 << 20))  # whole 1 MiB requests, as the adapter's io_chunk
    rounds: dict[str, list] = {k: [] for k in ("nvme_store_gbps", "nvme_load_gbps", "fio_write_gbps",
                                               "fio_read_gbps", "order")}
    out: dict[str, Any] = {"nvme_ok": True, "fio_bytes": fio_bytes if fio else None, "repeats": repeats}
    try:
        _lay_out(path, cap)
        for r in range(repeats):
            order = ("ucm", "fio") if r % 2 == 0 else ("fio", "ucm")
            rounds["order"].append("+".join(order))
            steps.set_postfix_str(f"round {r + 1}/{repeats}: nvme and fio")
            for who in order:
                if who == "ucm":
                    _invalidate_regions(path, cap, region)  # every round starts on an empty medium
                    store, load, ok, direct = _nvme_once(cfg, cap, path, srcs, dsts, batch)
                    rounds["nvme_store_gbps"].append(store)
                    rounds["nvme_load_gbps"].append(load)
                    out["nvme_ok"] = out["nvme_ok"] and ok
                    out["nvme_direct_io"] = direct
                elif fio:
                    got = _fio(path, fio_bytes, io_threads)
                    rounds["fio_write_gbps"].append(got.get("fio_write_gbps"))
                    rounds["fio_read_gbps"].append(got.get("fio_read_gbps"))
                    if "fio_error" in got:
                        out["fio_error"] = got["fio_error"]
            steps.update(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k in ("nvme_store_gbps", "nvme_load_gbps", "fio_write_gbps", "fio_read_gbps"):
        xs = [x for x in rounds[k] if x is not None]
        out[k] = round(statistics.median(xs), 3) if xs else None
    for ours, theirs, key in (("nvme_store_gbps", "fio_write_gbps", "nvme_store_vs_fio"),
                              ("nvme_load_gbps", "fio_read_gbps", "nvme_load_vs_fio")):
        paired = [a / b for a, b in zip(rounds[ours], rounds[theirs]) if a and b]
        if paired:
            out[key] = round(statistics.median(paired), 3)
    out["rounds"] = rounds
    return out


def _invalidate_regions(path: str, size: int, region: int) -> None:
    """Zeroes the last page of every region (its trailer), untimed: the next
    open finds every region empty and writes from the start of the file, at
    the offsets fio moves, instead of around the previous round's blocks."""
    page = bytes(4096)
    fd = os.open(path, os.O_WRONLY)
    try:
        for end in range(region, size + 1, region):
            os.pwrite(fd, page, end - len(page))
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_page_cache(path)


def _nvme_once(cfg: NvmeConfig, cap: int, path: str, srcs: list, dsts: list,
               batch: int) -> tuple[float, float, bool, bool]:
    """One round of the adapter: put every block under new keys into the
    region file, then get them with a freshly opened adapter. Returns store
    and load GB/s, whether every byte came back, and whether I/O was direct."""
    n, total = len(srcs), len(srcs) * len(srcs[0])
    keys = [os.urandom(16) for _ in range(n)]
    nv = NvmeAdapter(capacity_bytes=cap, config=cfg)  # opening (recovery) is not timed
    direct = nv.direct_io
    t = time.perf_counter()
    st = nv.put(keys, srcs)
    flushed = nv.flush()
    store = common.gbps(total, time.perf_counter() - t)
    nv.close()
    if not direct:
        drop_page_cache(path)
    nv = NvmeAdapter(capacity_bytes=cap, config=cfg)
    try:
        for d in dsts:
            d[:16] = bytes(16)
        t = time.perf_counter()
        for i in range(0, n, batch):
            st += nv.get(keys[i:i + batch], dsts[i:i + batch])
        load = common.gbps(total, time.perf_counter() - t)
    finally:
        nv.close()
    ok = flushed and all(s is Status.OK for s in st) and all(d[:] == s[:] for d, s in zip(dsts, srcs))
    return store, load, ok, direct


def measure_range(directory: str, size_mb: int, block_bytes: int, layers: int, batch: int, io_threads: int,
                  chunk_kbs: list[int]) -> dict[str, Any]:
    """Layer range reads vs whole-block reads from nvme (see the module doc)."""
    n = max(1, (size_mb << 20) // block_bytes)
    layer = block_bytes // layers
    srcs = [os.urandom(block_bytes) for _ in range(n)]
    keys = [os.urandom(16) for _ in range(n)]
    which = [(i * 7) % layers for i in range(n)]  # the layer read of block i: every offset parity
    res: dict[str, Any] = {"block_bytes": block_bytes, "blocks": n, "layer_bytes": layer, "layers": layers,
                           "batch": batch, "by_chunk": {}}
    ok = True
    for ckb in bar(chunk_kbs, desc="bench io --range", unit="chunk size"):
        work = tempfile.mkdtemp(prefix="ucm-bench-range-", dir=directory)
        try:
            region = 64 << 20
            while region < 2 * block_bytes:
                region *= 2
            cfg = NvmeConfig(path=work, region_size=region, io_threads=io_threads, io_chunk=1 << 20,
                             write_buffers=4, chunk_bytes=ckb << 10)
            cap = (n * block_bytes * 2 // region + 4) * region
            _lay_out(os.path.join(work, "ucm-regions.dat"), cap)
            with NvmeAdapter(capacity_bytes=cap, config=cfg) as nv:
                ok = ok and all(st is Status.OK for st in nv.put(keys, srcs)) and nv.flush()
                direct = nv.direct_io
            if not direct:
                drop_page_cache(os.path.join(work, "ucm-regions.dat"))
            # footer entry and chunk table, also what the index keeps per block
            r: dict[str, Any] = {"chunk_bytes": ckb << 10, "footer_bytes_per_block": nvme_format.ENTRY.size
                                 + nvme_format.n_chunks(block_bytes, ckb << 10) * nvme_format.CHUNK_SUM}
            with NvmeAdapter(capacity_bytes=cap, config=cfg) as nv:
                r["direct_io"] = nv.direct_io
                dsts = _buffers(batch, block_bytes)
                t = time.perf_counter()
                for i in range(0, n, batch):
                    got = nv.get(keys[i:i + batch], dsts[:len(keys[i:i + batch])])
                    ok = ok and got == [Status.OK] * len(got) and dsts[0][:] == srcs[i]
                r["whole_mbps"] = round(n * block_bytes / (time.perf_counter() - t) / 1e6, 1)
                outs = [bytearray(layer) for _ in range(batch)]
                before = nv.stats()["bytes_read"]
                t = time.perf_counter()
                for i in range(0, n, batch):
                    ks = keys[i:i + batch]
                    offs = [which[j] * layer for j in range(i, i + len(ks))]
                    got = nv.get_range(ks, offs, outs[:len(ks)])
                    ok = ok and got == [Status.OK] * len(ks) and outs[0] == srcs[i][offs[0]:offs[0] + layer]
                seconds = time.perf_counter() - t
                r["range_mbps"] = round(n * layer / seconds / 1e6, 1)
                r["range_amplification"] = round((nv.stats()["bytes_read"] - before) / (n * layer), 3)
                lat_w, lat_r = [], []
                for i in range(min(n, 200)):  # single calls, alternating, on blocks not read since the open
                    t = time.perf_counter()
                    nv.get([keys[i]], dsts[:1])
                    lat_w.append(time.perf_counter() - t)
                    j = n - 1 - i
                    t = time.perf_counter()
                    ok = ok and nv.get_range([keys[j]], [((which[j] + 1) % layers) * layer], outs[:1]) == [Status.OK]
                    lat_r.append(time.perf_counter() - t)
                r["whole_p50_ms"] = round(common.nearest_rank(lat_w, 0.5) * 1e3, 3)
                r["whole_p99_ms"] = round(common.nearest_rank(lat_w, 0.99) * 1e3, 3)
                r["range_p50_us"] = round(common.nearest_rank(lat_r, 0.5) * 1e6, 1)
                r["range_p99_us"] = round(common.nearest_rank(lat_r, 0.99) * 1e6, 1)
            res["by_chunk"][str(ckb << 10)] = r
        finally:
            shutil.rmtree(work, ignore_errors=True)
    res["ok"] = ok
    return res


def _stage(directory: str, srcs: list, keys: list[bytes], batch: int, io_threads: int,
           headroom: float) -> tuple[float, bool]:
    """GB/s of `acquire` staging NVMe-only blocks into the arena (see the
    module doc), and whether every staged block read back intact."""
    from ucm.cache.unified import UnifiedCache

    n, size = len(srcs), len(srcs[0])
    slot = (size + 4095) // 4096 * 4096
    dram_blocks = max(2 * batch, n // 4)
    work = tempfile.mkdtemp(prefix="ucm-bench-stage-", dir=directory)
    cfg = {"tiers": [
        {"adapter": "dram", "capacity": dram_blocks * slot, "headroom": headroom,
         "options": {"prefault": True}},
        {"adapter": "nvme", "capacity": 4 * n * slot + (256 << 20),
         "options": {"path": work, "region_size": "16MiB", "io_threads": io_threads}},
    ], "policy": {"name": "lru"}}
    expect = dict(zip(keys, srcs))
    staged, seconds, ok = 0, 0.0, True
    try:
        with UnifiedCache(cfg) as cache:
            for i in range(0, n, batch):  # each batch one prompt's chain of blocks
                cache.store(keys[i:i + batch], srcs[i:i + batch]).wait(120)
            cache.flush()
            below = [k for k, t in zip(keys, cache.locate(keys)) if t == "nvme"]
            fresh = srcs[0]
            for i in range(0, len(below) - batch + 1, batch):
                cache.store([os.urandom(16) for _ in range(batch)], [fresh] * batch).wait(120)
                time.sleep(0.1)
                group = below[i:i + batch]
                t = time.perf_counter()
                leases = cache.acquire(group)
                seconds += time.perf_counter() - t
                try:
                    for k, le in zip(group, leases):
                        ok = ok and le is not None and le.view == memoryview(expect[k])
                finally:
                    cache.release(leases)
                staged += len(group) * size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return common.gbps(staged, seconds), ok and staged > 0


def _lay_out(path: str, size: int) -> None:
    """Writes the region file once before timing, as fio lays out its file:
    both then measure writes into allocated space (a log store's steady
    state, where regions are reused), not file-system block allocation."""
    chunk = mmap.mmap(-1, 8 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for off in range(0, size, len(chunk)):
            os.pwrite(fd, chunk[:min(len(chunk), size - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)
        chunk.close()


def drop_page_cache(path: str) -> None:
    """Evicts a file from the OS page cache (written back first: dirty pages
    cannot be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fio(path: str, nbytes: int, iodepth: int) -> dict[str, Any]:
    """fio's sequential write, then read, of the first `nbytes` of `path`
    (an existing file), O_DIRECT, 1 MiB requests, `iodepth` in flight."""
    out: dict[str, Any] = {}
    for rw, key in (("write", "fio_write_gbps"), ("read", "fio_read_gbps")):
        cmd = ["fio", "--name=ucm", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--direct=1",
               "--ioengine=libaio", f"--iodepth={iodepth}", f"--size={nbytes}", "--offset=0",
               "--output-format=json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            out[key] = None
            out["fio_error"] = proc.stderr.strip()[-300:]
            continue
        job = json.loads(proc.stdout)["jobs"][0][rw]
        out[key] = round(job["io_bytes"] / (job["runtime"] / 1000.0) / 1e9, 3) if job["runtime"] else None
    return out


def run(args: argparse.Namespace) -> int:
    directory = args.dir or "/var/tmp"
    os.makedirs(directory, exist_ok=True)
    if args.tier is not None:
        from ucm.bench.cache.cluster_io import measure_tier

        res = measure_tier(args.tier, size_mb=args.size_mb, block_kb=args.block_kb, batch=args.batch,
                           repeats=args.repeats or 3, master=args.master, metadata_server=args.metadata_server,
                           pool=args.pool, redis_url=args.redis_url, directory=directory,
                           io_threads=args.io_threads)
        print(json.dumps(res, sort_keys=True, default=str))
        return 0 if res.get("ok") else 1
    if args.range:
        res = measure_range(directory, args.size_mb, args.block_kb * 1024, args.layers, args.batch,
                            args.io_threads, args.chunk_kb or [32, 64])
        print(json.dumps(res, sort_keys=True) if args.json else json.dumps(res, sort_keys=True, indent=1))
        return 0 if res["ok"] else 1
    res = measure(directory, args.size_mb, args.block_kb * 1024, args.batch, args.io_threads, not args.no_fio,
                  args.repeats or 5)
    common.report(res, args.json, _table, sort_keys=True)
    return 0 if res.get("dram_ok") and res.get("nvme_ok") else 1


def _table(res: dict[str, Any]) -> str:
    rounds = [f"{'rounds: ' + k:30s} {v}" for k, v in res["rounds"].items()]
    return "\n".join([common.key_values(res, 30, skip=("rounds",)), *rounds])
