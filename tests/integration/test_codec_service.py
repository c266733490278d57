"""A codec tier behind `ucm serve`: the client registers its namespace's
KV layout, the service encodes what it demotes with it, and a restarted
service learns the layout again when the client reconnects."""
import signal
import time

import torch
import yaml

from support import chain, start_service
from ucm.api import Outcome
from ucm.codecs.layout import planar_layout
from ucm.service import CacheClient

LAYOUT = planar_layout("bfloat16", 4, 2, 32, 64)  # 64 KiB blocks


def blocks(n, seed):
    keys, _ = chain(n, seed, 16)
    g = torch.Generator().manual_seed(seed)
    return keys, [torch.randn(LAYOUT.block_bytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8)
                  .numpy().tobytes() for _ in range(n)]


def nvme_stats(client):
    return client.stats()["tiers"]["nvme"]["adapter"]


def test_the_service_encodes_with_the_layout_the_client_registered_and_learns_it_again(tmp_path):
    sock = str(tmp_path / "ucm.sock")
    cfg = {"tiers": [{"adapter": "dram", "capacity": "2MiB"},
                     {"adapter": "nvme", "capacity": "32MiB", "codec": "int8",
                      "options": {"path": str(tmp_path / "nvme"), "region_size": "512KiB", "io_chunk": "128KiB"}}],
           "policy": {"name": "lru"}, "service": {"socket": sock, "metrics_port": None}}
    path = tmp_path / "ucm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = start_service(path, sock)
    client = CacheClient(sock)
    try:
        client.register_layout(LAYOUT)
        keys, data = blocks(60, 1)
        assert client.store(keys, data).wait(60) == [Outcome.DONE] * 60
        assert client.flush()
        s = nvme_stats(client)
        assert s["codec"] == "int8" and s["codec_raw_bytes_in"] > 0 and s.get("codec_fallback", 0) == 0
        assert s["codec_ratio"] > 1.85
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start_service(path, sock)
        deadline = time.time() + 10
        while client.lookup(keys[:1]) == 0 and time.time() < deadline:
            time.sleep(0.1)
        k2, d2 = blocks(60, 2)
        assert client.store(k2, d2).wait(60) == [Outcome.DONE] * 60
        assert client.flush()
        s = nvme_stats(client)
        assert s["codec_raw_bytes_in"] > 0 and s.get("codec_fallback", 0) == 0  # the layout came back with the client
        on_nvme = [k for k, t in zip(k2, client.locate(k2)) if t == "nvme"]
        out = [bytearray(LAYOUT.block_bytes) for _ in on_nvme]
        assert on_nvme and client.load(on_nvme, out).wait(30) == [Outcome.DONE] * len(on_nvme)
        want = dict(zip(k2, d2))
        for k, o in zip(on_nvme, out):
            x = torch.frombuffer(bytearray(want[k]), dtype=torch.bfloat16).float()
            y = torch.frombuffer(o, dtype=torch.bfloat16).float()
            assert 0 < ((x - y).norm() / x.norm()).item() < 0.01
    finally:
        client.close()
        proc.kill()
        proc.wait()
