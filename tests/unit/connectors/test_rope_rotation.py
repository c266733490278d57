"""Keys moved between positions (ucm/connectors/rope.py): against RoPE
applied directly at the target position, in both pairings; the spec's
digest; models whose positions cannot move are refused."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from ucm.connectors.rope import RopeSpec, rope_of, rotate  # noqa: E402
from ucm.errors import ModelError  # noqa: E402

DIM = 8
FREQ = tuple(1.0 / (10000 ** (2 * i / DIM)) for i in range(DIM // 2))


def _rope(x, positions, style):
    """RoPE written out per pair: the position's angle on each pair."""
    out = x.clone().double()
    for t, p in enumerate(positions):
        for i, f in enumerate(FREQ):
            a, b = (i, i + DIM // 2) if style == "half" else (2 * i, 2 * i + 1)
            angle = torch.tensor(p * f, dtype=torch.float64)
            c, s = torch.cos(angle), torch.sin(angle)
            xa, xb = x[..., t, a].double(), x[..., t, b].double()
            out[..., t, a], out[..., t, b] = xa * c - xb * s, xb * c + xa * s
    return out


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_a_rotated_key_is_the_key_at_the_new_position(style):
    spec = RopeSpec(style, FREQ)
    raw = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    at_p = _rope(raw, [3, 4, 5, 6, 7], style)
    at_q = _rope(raw, [900, 901, 902, 903, 904], style)
    assert torch.allclose(rotate(at_p, 897, spec), at_q, atol=1e-9)
    per_token = torch.tensor([897, 10, -3, 0, 1])
    want = _rope(raw, [900, 14, 2, 6, 8], style)
    assert torch.allclose(rotate(at_p, per_token, spec), want, atol=1e-9)
    f32 = rotate(at_p.float(), 897, spec)
    assert f32.dtype == torch.float32 and torch.allclose(f32.double(), at_q, atol=1e-5)


def test_the_digest_names_pairing_and_frequencies():
    assert RopeSpec("half", FREQ).digest == RopeSpec("half", FREQ).digest
    assert RopeSpec("half", FREQ).digest != RopeSpec("interleaved", FREQ).digest
    assert RopeSpec("half", FREQ).digest != RopeSpec("half", tuple(f * 0.5 for f in FREQ)).digest
    with pytest.raises(ModelError):
        RopeSpec("alibi", FREQ)
    with pytest.raises(ModelError, match="head size"):
        rotate(torch.zeros(3, DIM + 2), 1, RopeSpec("half", FREQ))


def _model(model_type, rope_type="default"):
    rotary = types.SimpleNamespace(inv_freq=torch.tensor(FREQ), rope_type=rope_type)
    return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type),
                                 model=types.SimpleNamespace(rotary_emb=rotary))


def test_models_whose_keys_cannot_move_are_refused():
    assert rope_of(_model("llama")).inv_freq == pytest.approx(FREQ)
    assert rope_of(_model("qwen2", "llama3")).style == "half"
    with pytest.raises(ModelError, match="model type 'gpt2'"):
        rope_of(_model("gpt2"))
    with pytest.raises(ModelError, match="rope type 'dynamic'"):
        rope_of(_model("llama", "dynamic"))
