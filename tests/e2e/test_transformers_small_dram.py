"""A document longer than the DRAM tier, on NVMe, restored whole by the
transformers connector: in process and through `ucm serve`.

The connector streams a hit layer by layer, which stages every block into
DRAM before any is given back; with a DRAM tier of 3 blocks and a 12-block
document only the first 3 used to come back (the rest were recomputed).
Now a stream that gets no slot for a block is given back and the hit is
read in parts instead (`read_slots`, whose parts stage a bounded share of
the tier each). The output equals transformers' own prefix reuse with the
whole document cached. A small random Llama (tests/e2e/hf_support.py)."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_support import TINY_ID, generate, reference, tiny_llama  # noqa: E402

BT = 16
DOC_BLOCKS = 12
NEW = 4


def _config(nvme_dir, block_bytes, **extra):
    return {"block_tokens": BT, "policy": {"name": "lru"}, **extra, "tiers": [
        {"adapter": "dram", "capacity": 3 * block_bytes + 8192, "options": {"prefault": False}},
        {"adapter": "nvme", "capacity": "64MiB", "options": {"path": nvme_dir, "region_size": "1MiB"}}]}


def _prompts():
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 512, (1, DOC_BLOCKS * BT), generator=g)
    return (torch.cat([doc, torch.randint(3, 512, (1, 5), generator=g)], 1),
            torch.cat([doc, torch.randint(3, 512, (1, 7), generator=g)], 1))


def _check(model, cache):
    from ucm.connectors.transformers import TransformersConnector

    a, b = _prompts()
    conn = TransformersConnector(model, cache, model_id=TINY_ID)
    try:
        generate(conn, a, NEW)
        assert conn.wait_stores()
        cache.flush()
        keys = conn.cache_for(a).rows[0].keys
        assert cache.locate(keys).count("nvme") >= DOC_BLOCKS - 3  # the DRAM tier holds 3 blocks at most
        out, c = generate(conn, b, NEW)
        assert c.restored_tokens == DOC_BLOCKS * BT  # the whole document, staged part by part
        assert torch.equal(out, reference(model, a, b, DOC_BLOCKS * BT, NEW)[0])
        s = conn.stats()
        assert s["load_failed_blocks"] == 0 and s["faults"] == 0
    finally:
        conn.close()


def _block_bytes(model):
    from ucm.connectors.transformers import build_namespace

    return build_namespace(model, BT, TINY_ID)[1].block_bytes


def test_in_process(nvme_dir):
    from ucm.cache.unified import UnifiedCache

    model = tiny_llama()
    with UnifiedCache(_config(nvme_dir, _block_bytes(model))) as cache:
        _check(model, cache)


def test_through_the_service(nvme_dir, tmp_path):
    import ucm

    model = tiny_llama()
    client = ucm.connect(_config(nvme_dir, _block_bytes(model),
                                 service={"name": f"small-{os.getpid()}", "socket": str(tmp_path / "s.sock")}))
    try:
        _check(model, client)
    finally:
        client.close()
