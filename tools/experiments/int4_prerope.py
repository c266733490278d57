"""Keys quantised before their rotary embedding (KVQuant's pre-RoPE
per-channel keys) and with a non-uniform 4-bit grid, docs/lab/benchmarks.md
("int4 keys: bits where the queries look", its first table). Same harness and metrics as int4_variants.py.

RoPE turns each channel pair (c, c + D/2) of a key by t x theta_c at
position t, so a channel whose pre-RoPE value is steady across tokens (the
large outlier channels are) oscillates after it, and a group over 32
tokens must span both signs. A codec cannot know a block's absolute
position, but it need not: rotating back by the position *inside the
block* (0..127) leaves every token turned by the same angle (the block's
first position times theta_c), a fixed rotation of each pair that keeps
the pre-RoPE steadiness. So `rel` uses in-block positions (what a codec
can do with only the model's rope theta in the layout), `abs` the true
positions (the bound).

Names: `k:pre_rel`, `k:pre_abs` (keys only, values exact, 4 bits per
channel over 32 tokens); `k:pre_rel_out<pct>` the same with that percent
of each (block, layer) segment kept exact; `k:nuq` a 16-level grid per
(layer, head) fit by Lloyd-Max on the group-normalised keys (post-RoPE);
`k:pre_nuq` both; `c:` prefixes the same keys with values per token over
64 channels (int4's second format without outliers).

Not part of the package: an experiment record, run with the development
install:

    PYTHONPATH=. .venv/bin/python tools/experiments/int4_prerope.py "k4_only;k:pre_rel;k:pre_abs;k:nuq"
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int4_variants as iv  # noqa: E402

THETA = 100000.0  # SmolLM2's rope_theta (rope_type default)


def rotate(k, offset, sign):
    """k [n, L, H, T, D]: turn each pair (c, c + D/2) by sign x (offset + t) x theta_c
    (HF Llama's rotate_half convention)."""
    n, L, H, T, D = k.shape
    inv = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    pos = torch.arange(T, dtype=torch.float64)[None, :] + offset[:, None]  # [n, T]
    ang = pos[..., None] * inv  # [n, T, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, None]
    sin = (sign * torch.cat([ang.sin(), ang.sin()], -1)).float()[:, None, None]
    x1, x2 = k[..., : D // 2], k[..., D // 2:]
    return k * cos + torch.cat([-x2, x1], -1) * sin


def lloyd_grid(u, levels=16, iters=12):
    """u: values in [0, 1] (any shape); 16 reconstruction levels fit by Lloyd-Max."""
    x = u.flatten()
    if x.numel() > 400_000:
        x = x[torch.randperm(x.numel())[:400_000]]
    c = torch.linspace(0, 1, levels)
    for _ in range(iters):
        idx = (x[:, None] - c[None]).abs().argmin(-1)
        s = torch.zeros(levels).index_add_(0, idx, x)
        m = torch.zeros(levels).index_add_(0, idx, torch.ones_like(x))
        c = torch.where(m > 0, s / m.clamp_min(1), c)
        c[0], c[-1] = 0.0, 1.0  # keep the ends: the group's min and max stay exact
        c = c.sort().values
    return c


def q_keys(k, nuq=False, out_frac=0.0, group=32):
    """keys per channel over `group` tokens, asymmetric, 4 bits (uniform, or a
    Lloyd-Max grid per (layer, head)), `out_frac` of each (block, layer) kept exact."""
    n, L, H, T, D = k.shape
    g = k.reshape(n, L, H, T // group, group, D)
    big = torch.finfo(torch.float32).max
    mask = iv.key_outliers(g, out_frac) if out_frac > 0 else torch.zeros_like(g, dtype=torch.bool)
    lo = torch.where(mask, torch.full_like(g, big), g).amin(-2, keepdim=True)
    hi = torch.where(mask, torch.full_like(g, -big), g).amax(-2, keepdim=True)
    span = (hi - lo).clamp_min(1e-12)
    if not nuq:
        s = span / 15
        z = torch.round(lo / s)
        deq = (torch.clamp(torch.round(g / s) - z, 0, 15) + z) * s
    else:
        u = ((g - lo) / span).clamp(0, 1)
        deq = torch.empty_like(g)
        for li in range(L):
            for h in range(H):
                uu = u[:, li, h]
                c = lloyd_grid(uu[~mask[:, li, h]])
                idx = (uu[..., None] - c).abs().argmin(-1)
                deq[:, li, h] = lo[:, li, h] + c[idx] * span[:, li, h]
    return torch.where(mask, g, deq).reshape(k.shape)


_base = iv.variant


def variant(name, blocks):
    if not (name.startswith("k:") or name.startswith("c:")) or name[2:] in ("sink4", "sink1", "had", "had_ch", "g16", "tok32", "b5") \
            or name[2:].startswith(("exactL", "out")) or name in ("c:cur", "c:A", "c:B", "c:C"):
        return _base(name, blocks)
    k, v = blocks[:, :, 0].float(), blocks[:, :, 1].float()
    opt = name[2:]
    n, T = k.shape[0], k.shape[3]
    nuq = "nuq" in opt
    out = float(opt.split("_out")[1]) / 100 if "_out" in opt else 0.0
    if opt.startswith("pre_abs"):
        off = torch.arange(n, dtype=torch.float64) * T
    elif opt.startswith(("pre_rel", "pre_nuq")):
        off = torch.zeros(n, dtype=torch.float64)
    else:
        off = None
    if off is None:
        k2 = q_keys(k, nuq=nuq, out_frac=out)
    else:
        k2 = rotate(q_keys(rotate(k, off, -1.0), nuq=nuq, out_frac=out), off, 1.0)
    v2 = v if name.startswith("k:") else iv.q_out_v(v, 64, 0)
    return torch.stack([k2, v2], 2).to(blocks.dtype)


iv.variant = variant

if __name__ == "__main__":
    # a self-check of the rotation: turning back and forth is the identity
    x = torch.randn(2, 1, 1, 128, 64)
    off = torch.tensor([0.0, 128.0], dtype=torch.float64)
    assert torch.allclose(rotate(rotate(x, off, -1.0), off, 1.0), x, atol=1e-5)
    iv.main(sys.argv[1].split(";"))
