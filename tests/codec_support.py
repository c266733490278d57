"""What the codec tier suites share (importable as `codec_support`: tests/
is on sys.path through tests/conftest.py): a small SmolLM2-like layout,
its blocks, a tier config, int8's reference decode and an in-memory
medium without checksums of its own."""
import torch

from support import chain
from ucm.adapters.base import Status, StorageAdapter
from ucm.codecs.layout import planar_layout
from ucm.codecs.quant import Int8Codec

LAYOUT = planar_layout("bfloat16", 4, 2, 32, 64)  # 64 KiB blocks
N = 40  # blocks: more than the 1 MiB of DRAM holds, so most are demoted


def cfg(nvme_dir, codec, dram="1MiB"):
    return {"tiers": [{"adapter": "dram", "capacity": dram},
                      {"adapter": "nvme", "capacity": "16MiB", "codec": codec,
                       "options": {"path": str(nvme_dir), "region_size": "512KiB", "io_chunk": "128KiB"}}],
            "policy": {"name": "lru"}}


def kv_blocks(n, seed):
    keys, _ = chain(n, seed, 16)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(LAYOUT.block_bytes // 2, generator=g) * 3).to(torch.bfloat16).view(torch.uint8)
            .numpy().tobytes() for _ in range(n)]
    return keys, data


def int8_decoded(raw):
    """What int8 makes of a block: the reference for its loads."""
    c = Int8Codec()
    enc = c.encode(memoryview(raw), LAYOUT)
    out = bytearray(len(raw))
    assert c.decode(memoryview(enc.meta), memoryview(enc.body), memoryview(out))
    return bytes(out)


class DictAdapter(StorageAdapter):
    """An in-memory medium without checksums of its own, so that the
    frame's checksums are the only line of defence."""

    name = "dict"

    def __init__(self):
        self.blobs = {}

    def put(self, keys, blobs):
        for k, b in zip(keys, blobs):
            self.blobs.setdefault(k, bytearray(b))
        return [Status.OK] * len(keys)

    def get(self, keys, dsts):
        out = []
        for k, d in zip(keys, dsts):
            b = self.blobs.get(k)
            if b is None:
                out.append(Status.NOT_FOUND)
            elif len(b) != len(d):
                out.append(Status.CORRUPT)
            else:
                memoryview(d).cast("B")[:] = b
                out.append(Status.OK)
        return out

    def contains(self, keys):
        return [k in self.blobs for k in keys]

    def delete(self, keys):
        return [self.blobs.pop(k, None) is not None for k in keys]

    def size_of(self, key):
        b = self.blobs.get(key)
        return None if b is None else len(b)

    def iter_keys(self):
        return iter(list(self.blobs))

    capacity_bytes = 1 << 30

    @property
    def used_bytes(self):
        return sum(map(len, self.blobs.values()))

    def close(self):
        pass
