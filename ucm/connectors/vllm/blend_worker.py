"""UcmCPUWorker: vLLM for CPU's worker that hands its model to ucm's
connector, for blended prefills (blend.py, decision 20).

vLLM builds its KV connector from the config alone and never hands it the
model; a blend must run the model's own layers over tokens vLLM does not
schedule. vLLM's documented `worker_cls` setting picks the worker class;
this one is vLLM's CPUWorker with one more step once the connector exists:

    vllm serve MODEL --worker-cls ucm.connectors.vllm.blend_worker.UcmCPUWorker \\
        --kv-transfer-config '{"kv_connector": "UCMConnector", ...}'
    LLM(model=..., worker_cls="ucm.connectors.vllm.blend_worker.UcmCPUWorker", kv_transfer_config=...)

Without it, blended requests are served as plain ones (the scheduler side
sees the worker class and does not claim them).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.worker.cpu_worker import CPUWorker


class UcmCPUWorker(CPUWorker):
    """CPUWorker that binds its model to ucm's connector (module docstring)."""

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        if has_kv_transfer_group():
            connector = get_kv_transfer_group()
            if hasattr(connector, "bind_model"):
                connector.bind_model(self.model_runner.model)

    def ucm_blend_stats(self) -> dict:
        """What the connector's blender did (for `LLM.collective_rpc`); {}
        without one."""
        if not has_kv_transfer_group():
            return {}
        blender = getattr(get_kv_transfer_group(), "blender", None)
        return blender.stats() if blender is not None else {}

    def ucm_blend_last_selected(self) -> list:
        """The positions the connector's last blend recomputed (for
        `LLM.collective_rpc`); [] without a blender."""
        if not has_kv_transfer_group():
            return []
        blender = getattr(get_kv_transfer_group(), "blender", None)
        return blender.last_selected() if blender is not None else []
