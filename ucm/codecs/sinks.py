"""Sink tokens: a block's first token, kept exact by `int4` when it is an
attention sink.

Attention heads park the attention they do not need on the first token of
the sequence (an attention sink): its key decides how much of every
head's attention goes there and its value is read with that weight, so a
quantisation error in either reaches every later token. Keeping that one
token's K and V exact lowers int4's teacher-forced KL markedly
(docs/lab/benchmarks.md, "int4: the sink token kept exact"); IntactKV (Liu
et al., 2024) keeps the same tokens' KV lossless in quantised LLMs.

A codec does not know where a block lies in its sequence, so it looks. A
sink's values are small (it is attended as a no-op): token 0 of a block is
taken for one when the mean over layers and KV heads of |v_0| / mean |v_t|
(t over every `SAMPLE`-th token of each page, token 0 included) is below
`SINK_RATIO`, set between the scores of a sequence's first block and of
its later blocks (docs/lab/benchmarks.md). A wrong guess costs bytes or
quality, never correctness: the frame records which rows it kept.

Rows are a layout's rows (ucm.codecs.layout): token 0 of head h of a
segment is the segment's row h x tokens. The kept rows are stored in the
codec's table order (layer, segment, head), each `channels` elements of
the block's dtype, as they were.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ucm.codecs.layout import KvLayout, segment_floats

SINK_RATIO = 0.5
SAMPLE = 4


class SinkRows:
    """Where a layout's token-0 rows lie, and the test on a block's values
    (built once per layout; needs every segment to have the same tokens and
    channels, as the quantisers do)."""

    def __init__(self, layout: KvLayout) -> None:
        rows = layout.block_rows()
        firsts, at = [], 0
        for _ in range(layout.num_layers):
            for s in layout.segments:
                firsts.append(rows[at:at + s.rows:s.tokens])  # row h x tokens: head h's token 0
                at += s.rows
        self.offsets = np.concatenate(firsts)  # byte offsets of the kept rows, table order
        self.row_bytes = layout.segments[0].channels * layout.elem_bytes
        self.bytes = len(self.offsets) * self.row_bytes
        self.per_layer = len(self.offsets) // layout.num_layers
        self._layout = layout
        self._values = [s for s in layout.segments if s.kind == "v"]

    def score(self, raw: memoryview) -> float:
        """The mean over layers and heads of |v_0| / mean |v_t| (NaN when the
        block has no values or values that are not finite)."""
        if not self._values:
            return float("nan")
        lay = self._layout
        with np.errstate(all="ignore"):
            ratios = []
            for seg in self._values:
                x = segment_floats(raw, lay, seg, SAMPLE if seg.page_tokens % SAMPLE == 0 else 1)
                norms = np.sqrt(np.einsum("lhtc,lhtc->lht", x, x))
                ratios.append(norms[..., 0] / norms.mean(-1))
            return float(np.mean(ratios))

    def is_sink(self, raw: memoryview) -> bool:
        return bool(self.score(raw) < SINK_RATIO)  # NaN: not a sink

    def gather(self, raw: memoryview, dst: np.ndarray) -> None:
        """Copies the token-0 rows of `raw` into `dst` (`bytes` bytes)."""
        src = np.frombuffer(raw, np.uint8)
        dst.reshape(-1, self.row_bytes)[:] = src[self.offsets[:, None] + np.arange(self.row_bytes)]

    def scatter(self, kept: memoryview, out: memoryview, first_layer: int = 0,
                last_layer: Optional[int] = None) -> None:
        """Writes the kept rows of layers [first_layer, last_layer) back into
        the decoded block `out`."""
        a = first_layer * self.per_layer
        b = len(self.offsets) if last_layer is None else last_layer * self.per_layer
        rows = np.frombuffer(kept, np.uint8).reshape(-1, self.row_bytes)[a:b]
        dst = np.frombuffer(out, np.uint8)
        dst[self.offsets[a:b, None] + np.arange(self.row_bytes)] = rows
