"""The bench's reference rows: `ulp` moves every nonzero element by exactly
one unit in the last place, `naive-int4` is symmetric 4-bit."""
import pytest
import torch

from ucm.bench.engines.codec_floors import naive_int4, one_ulp


@pytest.mark.parametrize("dtype,ulp", [(torch.bfloat16, 2.0 ** -7), (torch.float32, 2.0 ** -23)])
def test_one_ulp_moves_each_nonzero_element_by_one_ulp(dtype, ulp):
    x = (torch.randn(2, 3, 2, 3, 8, 16, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    x.view(-1)[:5] = 0
    y = one_ulp(x, seed=3)
    a, b = x.float().reshape(-1), y.float().reshape(-1)
    assert (b[:5] == 0).all()
    rel = (a[5:] - b[5:]).abs() / a[5:].abs()
    # one ulp of a value in [2^e, 2^(e+1)) is 2^e * ulp: relative ulp / 2 .. ulp
    assert (rel > 0).all() and (rel >= ulp / 2 * 0.999).all() and (rel <= ulp * 1.001).all()
    assert ((b > a)[5:].float().mean() - 0.5).abs() < 0.1  # up and down alike
    assert torch.equal(one_ulp(x, seed=3), y) and not torch.equal(one_ulp(x, seed=4), y)


def test_naive_int4_is_symmetric_with_at_most_15_levels_per_tile():
    x = torch.randn(1, 2, 2, 3, 128, 64, generator=torch.Generator().manual_seed(2))
    y = naive_int4(x)
    k, v = y[:, :, 0], y[:, :, 1]
    for t, dim in ((k, -2), (v, -1)):  # keys: per channel over the block; values: per token
        s = t.abs().amax(dim=dim, keepdim=True) / 7
        q = t / s
        assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 7 + 1e-4
