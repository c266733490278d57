"""Moving keys to other positions: a key computed at position p, rotated by
q - p, is the key the model computes at q.

RoPE turns each pair of a key's dimensions by the angle `position *
inv_freq[i]`; rotations compose (R(q) = R(q - p) R(p)), so a chunk's keys
computed at positions p.. move to q.. by one more rotation of q - p, and
its values, which carry no position, stay as they are. Two pairings are in
use, and the rotation must use the model's:
- `half` (the rotate-half form of Llama, Mistral, Qwen, Gemma in
  transformers and vLLM): dimension i pairs with i + d/2;
- `interleaved` (GPT-J, GLM): dimension 2i pairs with 2i + 1.

Exactness needs frequencies that do not depend on the sequence: rope types
`default`, `linear` (positions divided by a factor: folded into inv_freq)
and `llama3` (a fixed reshaping of inv_freq) qualify; a scale that
multiplies cos and sin (`attention_scaling`, e.g. YaRN's) is carried by the
stored key and kept by a pure rotation. `dynamic` NTK scaling, `longrope`
and models without RoPE (ALiBi, learned positions) are refused with a
ModelError: a chunk cannot be moved there, and the caller prefills it.

`RopeSpec.digest` names the rotation (pairing and every frequency), for the
namespace of entries whose keys were rotated with it: another base or
scaling is another namespace, so never a hit.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Union

import torch

from ucm.errors import ModelError

STYLES = ("half", "interleaved")
MOVABLE_ROPE_TYPES = ("default", "linear", "llama3")
# transformers model types whose attention applies RoPE in the rotate-half form to every layer's keys
HALF_ROPE_MODELS = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2")


@dataclass(frozen=True)
class RopeSpec:
    """How a model's keys carry their position: the pairing (`style`) and
    the frequency of each pair (`inv_freq`, float64 values)."""

    style: str
    inv_freq: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ModelError(f"rope style {self.style!r} is not one of {list(STYLES)}")
        if not self.inv_freq:
            raise ModelError("rope inv_freq is empty")

    @property
    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(self.style.encode())
        h.update(torch.tensor(self.inv_freq, dtype=torch.float64).numpy().tobytes())
        return h.hexdigest()


def rope_of(model: Any) -> RopeSpec:
    """The RoPE of a transformers model, or a ModelError saying why its keys
    cannot be moved between positions."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    cfg = get(decoder=True) if callable(get) else cfg
    kind = str(getattr(cfg, "model_type", ""))
    if kind not in HALF_ROPE_MODELS:
        raise ModelError(f"moving KV between positions: model type {kind!r} is not one whose RoPE is known here; "
                         f"supported: {list(HALF_ROPE_MODELS)}")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise ModelError(f"moving KV between positions: {kind!r} model has no rotary_emb.inv_freq")
    rope_type = str(getattr(rotary, "rope_type", "default"))
    if rope_type not in MOVABLE_ROPE_TYPES:
        raise ModelError(f"moving KV between positions: rope type {rope_type!r} has frequencies that depend on the "
                         f"sequence; movable: {list(MOVABLE_ROPE_TYPES)}")
    return RopeSpec("half", tuple(float(x) for x in inv_freq.detach().to("cpu", torch.float64)))


def _angles(spec: RopeSpec, delta: Union[int, torch.Tensor], n: int, device: Any) -> torch.Tensor:
    """[n, d/2] float64 angles delta * inv_freq (delta one int or [n])."""
    freq = torch.tensor(spec.inv_freq, dtype=torch.float64, device=device)
    d = torch.as_tensor(delta, dtype=torch.float64, device=device)
    d = d.expand(n) if d.dim() == 0 else d
    return d[:, None] * freq[None, :]


def rotate(keys: torch.Tensor, delta: Union[int, torch.Tensor], spec: RopeSpec) -> torch.Tensor:
    """`keys` ([..., tokens, head_dim], RoPE applied at some positions)
    moved by `delta` positions (an int, or one per token): a new tensor of
    the same dtype. The angles are computed in float64 and the rotation in
    float32 at least, so a bfloat16 key is rounded once."""
    n, dim = keys.shape[-2], keys.shape[-1]
    if dim != 2 * len(spec.inv_freq):
        raise ModelError(f"rotate: head size {dim} does not match {len(spec.inv_freq)} rope frequencies")
    ang = _angles(spec, delta, n, keys.device)
    work = torch.promote_types(keys.dtype, torch.float32)
    cos, sin = ang.cos().to(work), ang.sin().to(work)
    k = keys.to(work)
    if spec.style == "half":
        a, b = k[..., : dim // 2], k[..., dim // 2:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = k[..., 0::2], k[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return out.to(keys.dtype)
