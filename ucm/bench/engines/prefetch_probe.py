"""UCMConnector with a stopwatch, for `ucm bench prefetch` only.

vLLM loads it in its engine-core process (`kv_connector_module_path`
ucm.bench.engines.prefetch_probe); the scheduler half times, per request, how long
it was held up by I/O before it could run, and appends one JSON line per
finished request to the file named by `kv_connector_extra_config`
`bench_probe_path` (a key without the `ucm_` prefix, which UCMConnector
ignores):

- `staging_wait_s`: from the first `None` answer of
  get_num_new_matched_tokens (a prefetch policy waiting for its staging)
  to the answer that let it run;
- `async_load_s`: from the allocation of an asynchronous load (policy
  `off`, a hit below DRAM: the request holds its pages) to the step that
  reported it received (`finished_recving`).

Everything else is UCMConnector's own behaviour, unchanged.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

from ucm.connectors.vllm import UCMConnector as _Base


class UCMConnector(_Base):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._probe_path: Optional[str] = extra.get("bench_probe_path")
        self._wait_from: dict[str, float] = {}
        self._load_from: dict[str, float] = {}
        self._async: dict[str, bool] = {}  # a request's last answer: whether its load is asynchronous
        self._times: dict[str, dict[str, float]] = {}

    def _rec(self, rid: str) -> dict[str, float]:
        return self._times.setdefault(rid, {"staging_wait_s": 0.0, "async_load_s": 0.0, "none_answers": 0})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid, now = request.request_id, time.monotonic()
        self._async[rid] = is_async
        if n is None:
            self._wait_from.setdefault(rid, now)
            self._rec(rid)["none_answers"] += 1
        elif rid in self._wait_from:
            self._rec(rid)["staging_wait_s"] += now - self._wait_from.pop(rid)
        return n, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        # vLLM allocates after the answer that gave it `num_external_tokens`: that answer's is_async
        if num_external_tokens > 0 and self._async.get(request.request_id, False):
            self._load_from[request.request_id] = time.monotonic()

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        now = time.monotonic()
        for rid in connector_output.finished_recving or ():
            start = self._load_from.pop(rid, None)
            if start is not None:
                self._rec(rid)["async_load_s"] += now - start

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        out = super().request_finished(request, block_ids)
        rid = request.request_id
        rec = self._times.pop(rid, None) or {"staging_wait_s": 0.0, "async_load_s": 0.0, "none_answers": 0}
        self._wait_from.pop(rid, None)
        self._load_from.pop(rid, None)
        self._async.pop(rid, None)
        if self._probe_path:
            try:
                with open(self._probe_path, "a") as f:
                    f.write(json.dumps({"request_id": rid, **rec}) + "\n")
            except OSError:
                pass
        return out
