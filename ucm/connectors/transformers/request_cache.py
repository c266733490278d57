"""UCMCache: the transformers cache of one request (a batch of prompts),
whose prefix came from ucm and whose new full prompt blocks go back to it.

Made by `TransformersConnector.cache_for` (connector.py), which gives it
its rows (prompt_rows.PromptRow), the restored prefix (`adopt`, a
restore.Restored) and two functions: `on_forward(cache)`, which schedules
the store of the blocks a finished forward completed, and
`on_finish(cache, output_tokens)`, which tells the cache the request is
over. The connector reads `rows` and stops the stores (`stop_storing`);
everything else of the cache's state changes in its own methods.

The layers are layers.SpareLayer (they grow in place). In the first
forward, `update` checks that the caller gave the input ids the cache was
made for (else nothing of the request is stored), and lands the deferred
layers of a streamed prefix just before each layer's attention
(restore.DeferredLayers; RestoreFault when a block did not land). Runs in
the caller's thread, inside the model's forward.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from transformers.cache_utils import Cache, DynamicCache

from ucm.connectors.transformers.layers import SpareLayer
from ucm.connectors.transformers.prompt_rows import PromptRow
from ucm.connectors.transformers.restore import Restored, RestoreFault

log = logging.getLogger(__name__)


class UCMCache(DynamicCache):
    """A DynamicCache of one request whose prefix came from ucm (module
    docstring)."""

    def __init__(self, rows: list[PromptRow], prompt_len: int, num_layers: int, *,
                 on_forward: Callable[["UCMCache"], None], on_finish: Callable[["UCMCache", int], None],
                 store_after_token: bool = False) -> None:
        """`store_after_token` (`connector.generate`): a forward's new blocks
        are stored when the next forward starts (or generate returns), so
        their gather and copy never share the CPU with the forward that
        makes the token; else right after the forward's last layer."""
        Cache.__init__(self, layers=[SpareLayer() for _ in range(num_layers)])
        self._num_layers = num_layers
        self._rows = rows
        self._prompt_len = prompt_len
        self._on_forward, self._on_finish = on_forward, on_finish
        self.restored_tokens = 0  # sequence positions restored from ucm (padding included)
        self.restored_blocks = 0
        self._expect_new: Optional[int] = None  # tokens the first forward must bring
        self._storing = any(r.valid for r in rows)
        self._finished = False
        self._deferred: list = []  # restore.DeferredLayers the first forward lands layer by layer
        self._store_after_token = store_after_token
        self._store_due = False

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def rows(self) -> list[PromptRow]:
        """The request's prompts, in batch order."""
        return self._rows

    @property
    def storing(self) -> bool:
        """Whether blocks of this request may still be stored."""
        return self._storing

    def stop_storing(self) -> None:
        """Nothing more of this request is stored (all stored, or misuse)."""
        self._storing = False

    def expect_new(self, tokens: int) -> None:
        """The first forward must bring `tokens` new positions per row (the
        prompt after the restored prefix); checked in that forward."""
        self._expect_new = tokens

    def adopt(self, restored: Restored) -> None:
        """The restored prefix becomes the layers' content."""
        self._deferred = restored.deferred
        for layer, k, v in zip(self.layers, restored.keys, restored.values):
            layer.adopt(k, v, restored.length)
        self.restored_tokens = restored.length
        self.restored_blocks = restored.blocks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            if self._expect_new is not None:
                self._check_first_forward(key_states)
            self.store_due()  # the forward before this one is over: its token is out
        if self._deferred:
            self._land(layer_idx)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self._storing and layer_idx == len(self.layers) - 1:
            if self._store_after_token:
                self._store_due = True
            else:
                self._on_forward(self)
        return out

    def store_due(self) -> None:
        """Schedules the stores a finished forward left due (`generate`)."""
        if self._store_due:
            self._store_due = False
            if self._storing:
                self._on_forward(self)

    def _check_first_forward(self, key_states: torch.Tensor) -> None:
        expect, self._expect_new = self._expect_new, None
        if key_states.shape[0] != len(self._rows) or key_states.shape[-2] != expect:
            log.error("ucm: the cache made for %d prompts of %d tokens (%d restored) was given %d rows of %d new "
                      "tokens; pass generate the input ids and mask given to cache_for. Nothing of this request "
                      "is stored.", len(self._rows), self._prompt_len, self.restored_tokens, key_states.shape[0],
                      key_states.shape[-2])
            self._storing = False

    def _land(self, layer_idx: int) -> None:
        """The deferred copies of layer `layer_idx` (RestoreFault when a
        restored block did not land: nothing of this cache is stored)."""
        last = layer_idx == len(self.layers) - 1
        try:
            for d in self._deferred:
                d.land(layer_idx, last)
        except RestoreFault:
            self._storing = False
            self.drop_deferred()
            raise
        if last:
            self._deferred = []

    def drop_deferred(self) -> None:
        """Releases the deferred layers not landed yet (the request is over,
        or failed)."""
        for d in self._deferred:
            d.release()
        self._deferred = []

    def recompute(self) -> "UCMCache":
        """A cache for the same request with nothing restored (after a
        RestoreFault); this one is done with and finishes nothing."""
        self.drop_deferred()
        self._storing, self._finished = False, True
        fresh = UCMCache([PromptRow(r.pad, r.keys, r.request_id, r.valid) for r in self._rows], self._prompt_len,
                         self._num_layers, on_forward=self._on_forward, on_finish=self._on_finish,
                         store_after_token=self._store_after_token)
        fresh.expect_new(self._prompt_len)
        return fresh

    def finish(self, output_tokens: Optional[int] = None) -> None:
        """The request is over (`output_tokens` generated; default: what the
        cache saw). Idempotent; runs after this request's stores."""
        if self._finished:
            return
        self._finished = True
        if output_tokens is None:
            output_tokens = max(0, self.get_seq_length() - self._prompt_len + 1)
        self._on_finish(self, int(output_tokens))
