"""Keys coded in their principal directions with bits allocated by
variance (transform coding), docs/lab/benchmarks.md ("int4 keys in their
principal directions"): each (layer, KV head)'s keys rotated into the
right singular vectors of the document's own keys (an optimistic basis: a
codec would have to fit it on other text and carry it with the
namespace), each direction quantised over 32 tokens (asymmetric, as the
int4 codec does) with `b_c` bits, the bits given greedily to the
direction whose error drops most (error of b bits taken as range^2 x
4^-b, the high-rate model; 0 bits: the group mean), 4 bits per element on
average; then rotated back. Values exact (`k:`) or int4 per token over 64
channels (`c:`). Same harness and metrics as int4_variants.py.

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/int4_klt.py "k4_only;k:klt4;k:klt3;c:klt4"
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int4_variants as iv  # noqa: E402


def klt_keys(k, avg_bits, bmax=8, group=32):
    """k [n, L, H, T, D] float32 -> the same, coded in its principal directions."""
    n, L, H, T, D = k.shape
    x = k.permute(1, 2, 0, 3, 4).reshape(L, H, n * T, D).double()
    _, _, vt = torch.linalg.svd(x, full_matrices=False)  # [L, H, D, D]
    P = vt.transpose(-1, -2)  # columns: directions
    y = (x @ P).float()  # [L, H, nT, D]
    g = y.reshape(L, H, n * T // group, group, D)
    rng2 = ((g.amax(-2) - g.amin(-2)) ** 2).mean(-2)  # [L, H, D]: mean squared range per direction
    bits = torch.zeros(L, H, D, dtype=torch.long)

    def err(b):  # the high-rate model, convex in b: reverse water-filling over the directions
        return rng2 * 4.0 ** (-b.double())

    for _ in range(avg_bits * D):
        gain = err(bits) - err(bits + 1)
        gain = torch.where(bits >= bmax, torch.full_like(gain, -1e30), gain)
        j = gain.reshape(L * H, D).argmax(-1)
        bits.reshape(L * H, D)[torch.arange(L * H), j] += 1
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    lv = (2.0 ** bits[:, :, None, None, :].float()) - 1
    s = ((hi - lo) / lv.clamp_min(1)).clamp_min(1e-12)
    z = torch.round(lo / s)
    q = torch.minimum(torch.clamp(torch.round(g / s) - z, min=0), lv)
    out = torch.where(lv == 0, g.mean(-2, keepdim=True), (q + z) * s).reshape(L, H, n * T, D)
    xr = (out.double() @ P.transpose(-1, -2)).float()
    hist = torch.bincount(bits.flatten(), minlength=bmax + 1).tolist()
    print(f"klt{avg_bits}: bits per direction histogram {hist}", flush=True)
    return xr.reshape(L, H, n, T, D).permute(2, 0, 1, 3, 4)


_base = iv.variant


def variant(name, blocks):
    if ":klt" not in name:
        return _base(name, blocks)
    k, v = blocks[:, :, 0].float(), blocks[:, :, 1].float()
    kind, b = name.split(":klt")
    k2 = klt_keys(k, int(b))
    v2 = v if kind == "k" else iv.q_asym(v, -1, 64)
    return torch.stack([k2, v2], 2).to(blocks.dtype)


iv.variant = variant

if __name__ == "__main__":
    iv.main(sys.argv[1].split(";"))
