"""Sparse decode's attention pieces (ucm/connectors/transformers/sparse.py)
without a model: its eager base computes what transformers' eager does,
attention over gathered tokens equals attention with every other token
masked out (so tokens not gathered cannot matter), registration adds the
attention and mask functions, and bad configs name the value."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ucm.accelerators.sparse.base import Budget  # noqa: E402
from ucm.connectors.transformers.sparse import (SparseDecodeConfig, eager_attention, impl_name,  # noqa: E402
                                                register)
from ucm.errors import ConfigError  # noqa: E402


class Module(torch.nn.Module):
    num_key_value_groups = 3


def _qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, n, 64, generator=g),
            torch.randn(1, 3, n, 64, generator=g))


def test_eager_base_is_transformers_eager_bit_for_bit():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = _qkv(40)
    mask = torch.zeros(1, 1, 1, 40)
    mask[..., 5] = torch.finfo(torch.float32).min
    mine, _ = eager_attention(Module(), q, k, v, mask, scaling=0.125)
    ref, _ = eager_attention_forward(Module(), q, k, v, mask, scaling=0.125)
    assert torch.equal(mine, ref)


def test_attention_over_gathered_tokens_ignores_every_other_token():
    q, k, v = _qkv(64, 1)
    keep = torch.tensor([0, 1, 2, 3, 17, 18, 40, 41, 60, 61, 62, 63])
    out, _ = eager_attention(Module(), q, k[:, :, keep], v[:, :, keep], None, scaling=0.125)
    k2, v2 = k.clone(), v.clone()
    others = torch.ones(64, dtype=torch.bool)
    others[keep] = False
    k2[:, :, others] = 100.0  # would dominate any softmax that read them
    v2[:, :, others] = -100.0
    mask = torch.full((1, 1, 1, 64), torch.finfo(torch.float32).min)
    mask[..., keep] = 0
    masked, _ = eager_attention(Module(), q, k2, v2, mask, scaling=0.125)
    again, _ = eager_attention(Module(), q, k2[:, :, keep], v2[:, :, keep], None, scaling=0.125)
    assert torch.allclose(out, masked, atol=1e-6) and torch.equal(out, again)


def test_register_adds_attention_and_mask_functions_once():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register()
    fn = AttentionInterface()[impl_name("eager")]
    register()
    assert AttentionInterface()[impl_name("eager")] is fn
    assert impl_name("sdpa") in AttentionMaskInterface()


@pytest.mark.parametrize("bad,match", [({"base": "flash"}, "base"), ({"reselect_every": 0}, "reselect_every"),
                                       ({"selector": "magic"}, "magic")])
def test_bad_configs_name_the_value(bad, match):
    with pytest.raises(ConfigError, match=match):
        SparseDecodeConfig(budget=Budget.tokens(64), **bad)
