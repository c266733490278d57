"""Sink tokens: a block's first token, kept exact by `int4` when it is an
attention sink.

Attention heads park the attention they do not need on the first token of
the sequence (an attention sink): its key decides how much of every
head's attention goes there and its value is read with that weight, so a
quantisation error in either reaches every later token. On SmolLM2,
keeping that one token's K and V exact halves int4's teacher-forced KL
(docs/benchmarks.md, "int4: the sink token kept exact"); IntactKV (Liu et
al., 2024) keeps the same tokens' KV lossless in quantised LLMs.

A codec does not know where a block lies in its sequence, so it looks. A
sink's values are small (it is attended as a no-op): token 0 of a block is
taken for one when the mean over layers and KV heads of |v_0| / mean |v_t|
(t over every `SAMPLE`-th token of the block, token 0 included) is below
`SINK_RATIO`. On SmolLM2 the first block of a sequence scores 0.33-0.38
and every later block 0.66 or more (twelve documents, float32 and bf16). A wrong guess costs bytes
or quality, never correctness: the frame records which rows it kept.

Rows are a layout's rows (ucm.codecs.layout): token 0 of head h of a
segment is the segment's row h x tokens. The kept rows are stored in the
codec's table order (layer, segment, head), each `channels` elements of
the block's dtype, as they were.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ucm.codecs.layout import KvLayout

SINK_RATIO = 0.5
SAMPLE = 4


class SinkRows:
    """Where a layout's token-0 rows lie, and which elements the test reads
    (built once per layout; needs every segment to have the same tokens and
    channels, as the quantisers do)."""

    def __init__(self, layout: KvLayout) -> None:
        rows = layout.block_rows()
        eb = layout.elem_bytes
        firsts, values, at = [], [], 0
        for _ in range(layout.num_layers):
            for s in layout.segments:
                seg = rows[at:at + s.rows].reshape(s.heads, s.tokens)
                firsts.append(seg[:, 0])
                if s.kind == "v":
                    values.append(seg[:, ::SAMPLE])
                at += s.rows
        channels = layout.segments[0].channels
        self.offsets = np.concatenate(firsts)  # byte offsets of the kept rows, table order
        self.row_bytes = channels * eb
        self.bytes = len(self.offsets) * self.row_bytes
        self.per_layer = len(self.offsets) // layout.num_layers
        self._dtype = layout.dtype
        self._values: Optional[np.ndarray] = None
        if values:  # element indexes [layers x V segments, heads, sampled tokens, channels]
            v = np.stack(values) // eb
            self._values = v[..., None] + np.arange(channels, dtype=np.int64)

    def score(self, raw: memoryview) -> float:
        """The mean over layers and heads of |v_0| / mean |v_t| (NaN when the
        block has no values or values that are not finite)."""
        if self._values is None:
            return float("nan")
        x = _floats(raw, self._dtype, self._values)
        with np.errstate(all="ignore"):
            norms = np.sqrt(np.einsum("shtc,shtc->sht", x, x))
            return float((norms[..., 0] / norms.mean(-1)).mean())

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


def _floats(raw: memoryview, dtype: str, index: np.ndarray) -> np.ndarray:
    """The elements at `index` of a block of `dtype` as float32."""
    if dtype == "bfloat16":
        bits = np.frombuffer(raw, np.uint16)[index]
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, np.float16)[index].astype(np.float32)
    return np.frombuffer(raw, np.float32)[index]
