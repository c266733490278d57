"""Reference rows of `ucm bench codec` that are not codecs (bench only,
never stored): what a lossy codec's quality is measured against.

- `naive-int4`: the issue's floor to beat (symmetric 4-bit with int8's
  tiles: keys per channel over the block, values per token; no groups, no
  outliers).
- `ulp`: the exact cache with every nonzero element moved by one unit in
  the last place of its dtype, up or down at random (seeded): the smallest
  change a cache can undergo. In bfloat16 that is a relative change of
  2^-8 to 2^-7 per element, the same order as int8's error.
- `rechunk`: the same prefix's KV computed by the model in two forwards
  (first half, then the second half over the first half's cache) instead
  of one: what a second run of the engine that chunks its prefill hands
  back. Nothing is quantised; the blocks differ only by the order of the
  floating-point sums.

Each works on the bench's blocks, `[n, layers, 2, heads, tokens, dim]`.
"""
from __future__ import annotations

FLOORS = ("naive-int4", "ulp", "rechunk")


def naive_int4(blocks):
    """Symmetric 4-bit, keys per channel over each block, values per token."""
    import torch

    def rt(x, dim):
        s = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 7
        return torch.round(x / s).clamp(-7, 7) * s

    k = rt(blocks[:, :, 0].float(), dim=-2).to(blocks.dtype)
    v = rt(blocks[:, :, 1].float(), dim=-1).to(blocks.dtype)
    return torch.stack([k, v], dim=2)


def naive_int4_stored_bytes(blocks) -> int:
    """Nibbles and one fp16 scale per 64 elements (an estimate: not stored)."""
    return blocks.numel() // 2 + blocks.numel() // 64 * 2


def one_ulp(blocks, seed: int):
    """Every nonzero finite element one ulp up or down (random, seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[blocks.dtype]
    x = blocks.contiguous()
    step = torch.randint(0, 2, x.shape, generator=g).to(bits) * 2 - 1  # +-1 on the magnitude's bit pattern
    raw = x.view(bits).clone()
    ok = torch.isfinite(x) & (x != 0)
    # For a nonzero float, +-1 on its bit pattern moves the magnitude by one
    # ulp; a magnitude that would cross zero or into inf/nan is left alone.
    moved = raw + step
    back = moved.view(blocks.dtype)
    ok &= torch.isfinite(back) & (torch.sign(back) == torch.sign(x))
    return torch.where(ok, back, x)


def rechunked_prefix_cache(model, prefix):
    """The prefix's cache computed in two forwards (halves) instead of one."""
    half = prefix.shape[1] // 2
    first = model(prefix[:, :half], use_cache=True).past_key_values
    return model(prefix[:, half:], past_key_values=first, use_cache=True).past_key_values
