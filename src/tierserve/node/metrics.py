"""Prometheus metrics of a prefill or decode node, served on their own HTTP port."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierserve.api.engine_metrics import EngineCollector, StatsSource
from tierserve.core.gc_heap import GCCollector
from tierserve.node.sessions import RouterSessions

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
        r.register(GCCollector())

    def watch(self, sessions: RouterSessions) -> None:
        """Adds the routers' sessions (``node/sessions.py``) to the scrape."""
        self.registry.register(_SessionCollector(sessions))

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _SessionCollector:
    """Routers connected now, routers lost, and requests freed because their router was lost."""

    def __init__(self, sessions: RouterSessions) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.sessions
        yield GaugeMetricFamily("tierserve_router_sessions", "Routers with a session open to this node",
                                value=len(s.streams))
        yield CounterMetricFamily("tierserve_router_sessions_lost", "Routers whose last session with this node "
                                  "ended (they died or were stopped)", value=s.lost)
        yield CounterMetricFamily("tierserve_router_lost_requests", "Requests (reservations, generations, "
                                  "prefills) freed or aborted because the router that made them was lost",
                                  value=s.freed)
