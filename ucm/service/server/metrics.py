"""Prometheus metrics of the service, declared as data and read from the
cache at scrape time (nothing is counted twice on the hot path)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (name, kind, help, stats key) per tier
TIER_METRICS = (
    ("ucm_tier_capacity_bytes", "gauge", "Configured capacity of the tier", "capacity_bytes"),
    ("ucm_tier_used_bytes", "gauge", "Bytes of blocks resident in the tier", "used_bytes"),
    ("ucm_tier_blocks", "gauge", "Blocks resident in the tier", "blocks"),
    ("ucm_tier_hits", "counter", "Uses of blocks the tier holds (the placement policy's hits; a block staged up "
                                 "counts in the tier it was staged into)", "hits"),
    ("ucm_tier_served_blocks", "counter", "Blocks the tier delivered to loads, leases and range reads "
                                          "(a block staged up counts in the tier it came from)", "served_blocks"),
    ("ucm_tier_inserts", "counter", "Blocks that entered the tier", "inserts"),
    ("ucm_tier_evictions", "counter", "Blocks evicted from the tier", "evictions"),
    ("ucm_tier_demotions_in", "counter", "Blocks demoted into the tier from the one above", "demotions_in"),
    ("ucm_tier_promotions_in", "counter", "Blocks promoted (staged) into the tier from below", "promotions_in"),
    ("ucm_tier_written_bytes", "counter", "Bytes written into the tier", "bytes_written"),
)
# (name, help, stats key) for the whole cache
CACHE_COUNTERS = (
    ("ucm_cache_hit_blocks", "Blocks loaded for clients", "loaded_blocks"),
    ("ucm_cache_miss_blocks", "Blocks asked for but not cached", "missing_blocks"),
    ("ucm_cache_loaded_bytes", "Bytes handed to clients", "bytes_loaded"),
    ("ucm_cache_stored_blocks", "Blocks stored by clients", "stored_blocks"),
    ("ucm_cache_stored_bytes", "Bytes stored by clients", "bytes_stored"),
    ("ucm_cache_corrupt_blocks", "Blocks that came back with a bad checksum", "corrupt"),
    ("ucm_cache_failed_blocks", "Blocks whose I/O failed", "failed"),
    ("ucm_cache_lookups", "Lookups the service answered (clients answer most from the shared key index)", "lookups"),
    ("ucm_cache_headroom_evictions", "Blocks evicted (demoted or dropped) ahead of need to keep tiers' headroom",
     "headroom_evictions"),
)


class _CacheCollector:
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats()
        for name, kind, help_, key in TIER_METRICS:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_, labels=["tier"])
            for tier, t in stats["tiers"].items():
                fam.add_metric([tier], t[key])
            yield fam
        for name, help_, key in CACHE_COUNTERS:
            yield CounterMetricFamily(name, help_, value=stats.get(key, 0))


class Metrics:
    """Serves /metrics on host:port (port 0: any free port)."""

    def __init__(self, cache: Any, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_CacheCollector(cache))
        self.latency = Histogram("ucm_service_request_seconds", "Service request latency", ["op"],
                                 registry=self.registry,
                                 buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025, 0.1, 1.0))
        self._children: dict[str, Any] = {}
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.address = f"{host}:{self._server.server_port}"

    def observe(self, op: str, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self.latency.labels(op)
        child.observe(seconds)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
