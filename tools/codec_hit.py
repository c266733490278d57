"""Probe: an NVMe-only hit through `ucm serve` with a codec on the NVMe tier
(issue #21), without an engine.

    python -m tools.codec_hit [--codecs none,int8,lossless] [--samples 7]
                                  [--dram-blocks 48] [--headroom 0] [--inproc] [--stream]

Per codec a private service (`ucm.connect`) with a DRAM tier of
`--dram-blocks` blocks of the default model's geometry (30 layers x 3 KV
heads x 128 tokens x 64, bf16: 2,949,120 B, layout registered) over a
direct-I/O nvme tier with that codec. 23 blocks are stored; before each
sample filler blocks push them to NVMe (as `ucm bench vllm` does), then
they are read back with `read_slots`, as vLLM's connector loads (16 MiB
`acquire` parts, each staging NVMe -> DRAM and demoting as many DRAM
blocks as it stages), and again (a DRAM hit). `--stream`: then pushed to
NVMe again and streamed back (`stream_slots`, 30 layers, as the
connector's layer-wise load does): the seconds until layer 0 of every
block landed (when an engine's first layer could start) and until all
did. Prints one JSON line per codec: every NVMe-only hit's seconds and
the medians.

`--inproc`: the same hit on a UnifiedCache in this process (`acquire` in
parts of 5 blocks), with the seconds spent per stage and thread (encode,
decode, the staging's eviction steps, its batched reads) on stderr: where
the time of a hit goes (it wraps those internal methods with timers, in
this process only: a diagnostic). Measures only; asserts nothing.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from ucm.bench.blocks import chain, push_below_dram
from ucm.codecs.layout import planar_layout

LAYOUT = planar_layout("bfloat16", 30, 3, 128, 64)  # the default model's bf16 block: 2,949,120 B
BB = LAYOUT.block_bytes
DOC = 23


def kv_blocks(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f = rng.standard_normal(BB // 2, dtype=np.float32)
        out.append((f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).tobytes())  # bf16
    return out


def config(work, codec, dram_blocks, headroom, tag=""):
    nv = work / f"nvme-{codec}{tag}"
    nv.mkdir()
    t1 = {"adapter": "nvme", "capacity": "1024MiB",
          "options": {"path": str(nv), "region_size": "16MiB", "direct_io": True}}
    if codec != "none":
        t1["codec"] = codec
    t0 = {"adapter": "dram", "capacity": f"{dram_blocks * BB >> 20}MiB",
          "options": {"path": "/dev/shm", "prefault": False}}
    if headroom:
        t0["headroom"] = headroom
    cfg = {"block_tokens": 128, "tiers": [t0, t1], "policy": {"name": "lru"},
           "service": {"name": f"codec-probe-{os.getpid()}-{codec}{tag}", "socket": str(work / f"ucm-{codec}{tag}.sock")}}
    p = work / f"ucm-{codec}{tag}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def push_to_nvme(cache, keys, fill_src):
    return push_below_dram(cache, keys, BB, limit=200, filler=fill_src)


def stream_times(client, keys):
    """A streamed load of `keys` (as vLLM's connector streams an NVMe-only
    hit): seconds until layer 0 of every block landed, and until all did."""
    t0 = time.perf_counter()
    s = client.stream_slots(keys, [BB] * DOC, LAYOUT.num_layers)
    try:
        assert all(s.wait_layer(0, 60.0)), "layer 0 did not land"
        first = time.perf_counter() - t0
        assert all(o.name == "DONE" for o in s.outcomes(60.0))
        return first, time.perf_counter() - t0
    finally:
        s.release()


def service_run(work, codec, samples, dram_blocks, headroom, stream=False):
    import ucm
    path = config(work, codec, dram_blocks, headroom)
    client = ucm.connect(str(path))
    assert client.connected
    try:
        client.register_layout(LAYOUT)
        keys = chain(DOC, 7)
        data = kv_blocks(DOC, 7)
        fill_src = kv_blocks(1, 99)[0]
        assert all(o.name == "DONE" for o in client.store(keys, data).wait(60))
        dst = np.empty(DOC * BB, dtype=np.uint8)

        def fill(first, slots, arena):
            a = np.frombuffer(arena, dtype=np.uint8)
            for i, s in enumerate(slots):
                if s is not None:
                    o, n = s
                    dst[(first + i) * BB:(first + i + 1) * BB] = a[o:o + n]

        nvme_s, dram_s, tiers, first_s = [], [], [], []
        for _ in range(samples):
            where = push_to_nvme(client, keys, fill_src)
            tiers.append(sum(t == "nvme" for t in where))
            time.sleep(0.5)  # the headroom thread's work between requests
            t0 = time.perf_counter()
            out = client.read_slots(keys, [BB] * DOC, fill)
            nvme_s.append(time.perf_counter() - t0)
            assert all(o.name == "DONE" for o in out), out
            if codec in ("none", "lossless"):
                assert dst.tobytes() == b"".join(data)
            t0 = time.perf_counter()
            out = client.read_slots(keys, [BB] * DOC, fill)
            dram_s.append(time.perf_counter() - t0)
            if stream:
                push_to_nvme(client, keys, fill_src)
                time.sleep(0.5)
                first_s.append(stream_times(client, keys))
        st = client.stats()["tiers"]["nvme"]["adapter"]
        out = {"codec": codec, "nvme_hit_s": [round(x, 4) for x in nvme_s],
               "nvme_hit_median_s": round(statistics.median(nvme_s), 4),
               "dram_hit_median_s": round(statistics.median(dram_s), 4),
               "on_nvme": tiers, "codec_ratio": st.get("codec_ratio")}
        if stream:
            out["stream_layer0_s"] = [round(a, 4) for a, _ in first_s]
            out["stream_layer0_median_s"] = round(statistics.median(a for a, _ in first_s), 4)
            out["stream_all_median_s"] = round(statistics.median(b for _, b in first_s), 4)
            out["codec_layer_decoded_blocks"] = st.get("codec_layer_decoded_blocks", 0)
        return out
    finally:
        client.close()  # the private service exits once idle


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codecs", default="none,int8,lossless")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--dram-blocks", type=int, default=48)
    ap.add_argument("--headroom", type=float, default=0.0)
    ap.add_argument("--inproc", action="store_true")
    ap.add_argument("--stream", action="store_true",
                    help="also a streamed NVMe-only hit per sample: time to layer 0 of every block, and to all")
    a = ap.parse_args()
    import ucm
    print("ucm from", ucm.__file__, file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="ucm-codec-probe-", dir="/var/tmp"))
    cwd = os.getcwd()
    os.chdir(work)
    try:
        if a.inproc:
            res = [inproc_run(work, c, a.samples, a.dram_blocks, a.headroom) for c in a.codecs.split(",")]
        else:
            res = [service_run(work, c, a.samples, a.dram_blocks, a.headroom, a.stream) for c in a.codecs.split(",")]
    finally:  # each codec's NVMe tier wrote 1.6 GB of regions here
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    for r in res:
        print(json.dumps(r))




def inproc_run(work, codec, samples, dram_blocks, headroom, part_blocks=5):
    """The same hit in process (UnifiedCache.acquire, parts of `part_blocks`
    as the client asks them), with the time of each stage by thread."""
    from ucm.cache.unified import UnifiedCache
    from ucm.codecs import tier as ctier
    from ucm.tiers import key_order, stack as tmod
    spent = defaultdict(float)
    lock = threading.Lock()

    def wrap(obj, name, label):
        f = getattr(obj, name)

        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                with lock:
                    spent[(label, threading.current_thread().name.split("_")[0])] += time.perf_counter() - t0
        setattr(obj, name, g)
    wrap(ctier.CodecAdapter, "_encode", "encode")
    wrap(ctier.CodecAdapter, "_decode", "decode")
    wrap(ctier.CodecAdapter, "get", "codec.get(total)")
    wrap(tmod.TierStack, "wait_frees", "wait_frees")
    wrap(key_order.KeyOrder, "wait_turn", "wait_turn")
    wrap(tmod.TierStack, "_execute", "execute(step)")
    wrap(tmod.TierStack, "_copy_batch", "copy_batch")
    path = config(work, codec, dram_blocks, headroom, tag="-ip")
    cache = UnifiedCache(str(path))
    try:
        cache.register_layout(LAYOUT)
        keys = chain(DOC, 7)
        data = kv_blocks(DOC, 7)
        fill_src = kv_blocks(1, 99)[0]
        cache.store(keys, data).wait(60)
        hits = []
        for _ in range(samples):
            push_to_nvme(cache, keys, fill_src)
            time.sleep(0.5)
            spent.clear()
            t0 = time.perf_counter()
            for i in range(0, DOC, part_blocks):
                leases = cache.acquire(keys[i:i + part_blocks])
                assert all(le is not None for le in leases)
                cache.release(leases)
            hits.append(time.perf_counter() - t0)
            ahead = {k: v for k, v in cache.stats()["tiers"]["nvme"]["adapter"].items() if "read_ahead" in k}
            print(codec, "hit %.4f" % hits[-1], {f"{k[0]}@{k[1]}": round(v, 4) for k, v in sorted(spent.items())},
                  ahead, file=sys.stderr)
        return {"codec": codec, "inproc_hit_median_s": round(statistics.median(hits), 4)}
    finally:
        cache.close()


if __name__ == "__main__":
    main()
