"""Which of a blended prompt's tokens are recomputed: the part of the
`blend` accelerator's selection (ucm/accelerators/blend.py) that does not
depend on the engine. The transformers connector
(ucm/connectors/transformers/blend.py) and the vLLM one
(ucm/connectors/vllm/blend.py) compute the layers and the criterion (the
deviation; the question's attention, whose weights `question_mass` sums
for vLLM) with their engine's modules and pick the tokens here.

Positions are indices into the blended part of the prompt, [0, n). A token
is `reused` where a chunk's entry supplied its KV, `exact` where that KV is
what a full prefill computes (the system prompt's); the others (text
between chunks, the part of a chunk after its last whole block) are always
recomputed in every layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ucm.accelerators.blend import BlendOptions


@dataclass
class Selection:
    """The tokens recomputed in every layer after the checked ones (`chosen`,
    a mask over [0, n)), and under `deviation` or `question`, the `budget`
    more that the criterion (the deviation at the check layer, the
    question's attention) picks among `candidates`."""

    chosen: torch.Tensor
    candidates: Optional[torch.Tensor] = None
    budget: int = 0

    def add_top(self, score: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`chosen` with the `budget` candidates of largest `score` (the
        criterion: one non-negative value per token at `positions`) added;
        answers it."""
        if self.candidates is None or self.budget <= 0:
            return self.chosen
        score = score.clone()
        score[~self.candidates[positions]] = -1.0
        self.chosen[positions[torch.topk(score, min(self.budget, len(score))).indices]] = True
        return self.chosen


def checked_layers(options: BlendOptions, num_layers: int) -> int:
    """The layers computed for every token after the system prompt before
    the deviation is measured (0 when no deviation is measured)."""
    if options.select == "deviation" and options.ratio > 0:
        return min(options.check_layers, num_layers)
    return 0


def question_layers(options: BlendOptions, num_layers: int) -> range:
    """Under `question`, the layers whose attention picks the tokens: from
    `question_from_layer` (half the layers when unset; the last layer
    where it is past it) to the last."""
    first = num_layers // 2 if options.question_from_layer is None else options.question_from_layer
    return range(min(first, num_layers - 1), num_layers)


def select(options: BlendOptions, reused: torch.Tensor, exact: torch.Tensor,
           spans: Sequence[tuple[int, int]], n: int) -> Selection:
    """The selection before any deviation is known: tokens without a
    reused entry; under `leading`, each chunk's first `leading_tokens`;
    under `deviation` or `question` with a ratio above 0, each chunk's
    first `anchor_tokens` within the ratio's budget, and the rest of the
    budget (a `ratio` of the reused tokens after the system prompt) left
    to the criterion."""
    chosen = ~reused[:n]
    if options.select == "leading":
        for s, e in spans:
            chosen[s:min(s + options.leading_tokens, e, n)] = True
        return Selection(chosen)
    if options.ratio <= 0.0:
        return Selection(chosen)
    candidates = reused[:n] & ~exact[:n]
    budget = math.ceil(options.ratio * int(candidates.sum()))
    for s, e in spans:  # anchors: each passage's first tokens, within the ratio's budget
        take = candidates[s:min(s + options.anchor_tokens, e, n)]
        budget -= int(take.sum())
        chosen[s:s + len(take)] |= take
        candidates[s:s + len(take)] = False
    return Selection(chosen, candidates, max(0, budget))


def question_mass(query: torch.Tensor, keys: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """Per position [0, n), the attention the question's queries pay it in
    one layer, summed over heads and queries: `query` `[q, heads,
    head_size]` (after RoPE) for the positions n..n+q-1, `keys` `[n + q,
    kv_heads, head_size]` the layer's keys of every position up to the
    question's last (the question's own after the n blended ones); query
    head h reads KV head h // (heads // kv_heads); each query attends
    causally (over the keys up to its own position), in float32."""
    q, heads, d = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    grouped = query.float().view(q, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(kv_heads, groups * q, d)
    scores = torch.matmul(grouped, keys.float().permute(1, 2, 0)) * scale  # [kv_heads, groups * q, n + q]
    scores = scores.view(kv_heads, groups, q, n + q)
    later = torch.arange(n + q)[None, :] > (n + torch.arange(q))[:, None]  # [q, n + q]: keys after the query
    scores.masked_fill_(later, float("-inf"))
    return torch.softmax(scores, dim=-1)[..., :n].sum(dim=(0, 1, 2))
