"""The worker half of UCMConnector streams a hit below DRAM layer by layer
(LoadJob.stream): wait_for_layer_load(layer) copies that layer's pages as
it lands, over a real in-process cache (dram + nvme). A corrupted layer
range is a miss for its block: the pages of that block and of every later
block of the request become load errors (vLLM recomputes them), the
earlier blocks' pages hold exactly the stored bytes, and nothing waits
for long."""
import os

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402

from support import chain  # noqa: E402
from ucm.api import Outcome  # noqa: E402
from ucm.cache.unified import UnifiedCache  # noqa: E402
from ucm.connectors.vllm.metadata import LoadJob, UCMConnectorMetadata  # noqa: E402
from ucm.connectors.vllm.settings import ConnectorSettings  # noqa: E402
from ucm.connectors.vllm.worker import UCMWorkerSide  # noqa: E402

B, L = 12, 4  # KV pages, layers (one page per ucm block)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SHAPE = (B, 4, 128, 64)  # bf16: a 64 KiB page, so one layer's range is two 32 KiB chunks
LAYER = 4 * 128 * 64 * 2


def cfg(nvme_dir):
    return {"tiers": [{"adapter": "dram", "capacity": "4MiB"},
                      {"adapter": "nvme", "capacity": "64MiB",
                       "options": {"path": nvme_dir, "region_size": "2MiB", "io_chunk": "512KiB"}}],
            "landing_tier": "dram", "policy": {"name": "lru"}}


def payload(kv, page):
    """A block's bytes as the worker saves them: layer by layer, its page."""
    return b"".join(kv[n][page].contiguous().view(torch.uint8).numpy().tobytes() for n in NAMES)


def stored_on_nvme(nvme_dir, kv, pages):
    keys = chain(len(pages), 7)[0]
    blobs = [payload(kv, p) for p in pages]
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.store(keys, blobs).wait(30) == [Outcome.DONE] * len(keys)
        filler, fdata = chain(20, 70, len(blobs[0]))
        assert c.store(filler, fdata).wait(30) == [Outcome.DONE] * 20
        assert c.flush()
    return keys, blobs


class WaitsSeen:
    """The cache the worker streams from, passed through, recording for each
    wait on a stream whether what it waited for had settled when it
    returned (a layer landed or failed for every block, the stream
    finished): False is a wait that ran into its deadline."""

    def __init__(self, cache):
        self.cache = cache
        self.settled = []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def stream_slots(self, *args, **kwargs):
        return _SeenStream(self.cache.stream_slots(*args, **kwargs), self.settled)


class _SeenStream:
    def __init__(self, inner, settled):
        self.inner = inner
        self.settled = settled

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wait_layer(self, layer, timeout_s):
        got = self.inner.wait_layer(layer, timeout_s)
        self.settled.append(self.inner.progress.landed(layer) is not None)
        return got

    def outcomes(self, timeout_s):
        got = self.inner.outcomes(timeout_s)
        self.settled.append(self.inner.progress.finished())
        return got


def streamed_step(cache, keys, dst_pages):
    w = UCMWorkerSide(cache, pages_per_block=1, num_kv_blocks=B, settings=ConnectorSettings(load_timeout_s=20.0))
    kv = {n: torch.zeros(SHAPE, dtype=torch.bfloat16) for n in NAMES}
    w.register_kv_caches(kv)
    meta = UCMConnectorMetadata(loads=[LoadJob("r", keys, [[p] for p in dst_pages], False, True)])
    w.start_load_kv(meta)
    for name in NAMES:  # the forward, layer by layer
        w.wait_for_layer_load(name)
    w.wait_for_save(meta)
    errors = w.get_block_ids_with_load_errors()
    w.shutdown()
    return kv, errors, w


def test_a_streamed_load_fills_every_layer_of_the_pages(nvme_dir):
    src = {n: torch.randn(SHAPE).to(torch.bfloat16) for n in NAMES}
    keys, _ = stored_on_nvme(nvme_dir, src, [0, 1, 2])
    with UnifiedCache(cfg(nvme_dir)) as c:
        assert c.locate(keys) == ["nvme"] * 3
        kv, errors, w = streamed_step(c, keys, [5, 6, 7])
        assert errors == set()
        for n in NAMES:
            for s, d in ((0, 5), (1, 6), (2, 7)):
                assert torch.equal(kv[n][d], src[n][s])
            assert kv[n][8].abs().sum() == 0  # no other page touched
        assert w.counters["loaded_blocks"] == 3
        assert c.locate(keys) == ["dram"] * 3


def test_a_corrupted_layer_range_is_a_miss_for_its_block_and_the_rest(nvme_dir):
    src = {n: torch.randn(SHAPE).to(torch.bfloat16) for n in NAMES}
    keys, blobs = stored_on_nvme(nvme_dir, src, [0, 1, 2])
    path = os.path.join(nvme_dir, "ucm-regions.dat")
    raw = open(path, "rb").read()
    pos = raw.find(blobs[1][2 * LAYER:2 * LAYER + 4096]) + 10  # layer 2 of block 1
    assert pos > 10
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([raw[pos] ^ 0x40]))
    with UnifiedCache(cfg(nvme_dir)) as c:
        seen = WaitsSeen(c)
        kv, errors, w = streamed_step(seen, keys, [5, 6, 7])
        assert seen.settled and all(seen.settled), seen.settled  # no wait ran into the 20 s deadline
        assert errors == {6, 7}  # block 1 and the block after it: vLLM recomputes them
        for n in NAMES:
            assert torch.equal(kv[n][5], src[n][0])
        assert w.counters["loaded_blocks"] == 1
        assert c.lookup(keys) == 1  # the corrupt block is forgotten


def test_a_stream_whose_layer_waits_never_came_is_not_trusted(nvme_dir):
    src = {n: torch.randn(SHAPE).to(torch.bfloat16) for n in NAMES}
    keys, _ = stored_on_nvme(nvme_dir, src, [0, 1])
    with UnifiedCache(cfg(nvme_dir)) as c:
        w = UCMWorkerSide(c, pages_per_block=1, num_kv_blocks=B, settings=ConnectorSettings())
        w.register_kv_caches({n: torch.zeros(SHAPE, dtype=torch.bfloat16) for n in NAMES})
        meta = UCMConnectorMetadata(loads=[LoadJob("r", keys, [[3], [4]], False, True)])
        w.start_load_kv(meta)
        w.wait_for_layer_load(NAMES[0])  # the forward skipped the other layers' waits
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == {3, 4}
        w.shutdown()
