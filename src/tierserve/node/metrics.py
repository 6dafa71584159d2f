"""Prometheus metrics of a prefill or decode node, served on their own HTTP port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from tierserve.api.engine_metrics import EngineCollector, StatsSource

_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class NodeMetrics:
    """Engine occupancy and cache counters (one snapshot per scrape) plus the handoffs' own."""

    def __init__(self, engine: StatsSource) -> None:
        self.registry = r = CollectorRegistry()
        self.handoffs = Counter("tierserve_handoffs", "KV handoffs ended, by outcome", ["outcome"], registry=r)
        self.handoff_integrity_failures = Counter(
            "tierserve_handoff_integrity_failures", "Requests whose handed-over KV failed its digest check "
            "(decode nodes, --handoff-integrity); each failed, none answered from that KV", registry=r)
        self.transfer_bytes = Counter("tierserve_transfer_bytes", "KV bytes written into decode nodes", registry=r)
        self.transfer_seconds = Histogram("tierserve_transfer_seconds", "First KV submission to last completion",
                                          buckets=_TRANSFER_BUCKETS, registry=r)
        self.exposed_seconds = Histogram("tierserve_transfer_exposed_seconds",
                                         "KV transfer time left after the prompt's compute (not hidden)",
                                         buckets=_TRANSFER_BUCKETS, registry=r)
        r.register(EngineCollector(engine))

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
