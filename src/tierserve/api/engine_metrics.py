"""Prometheus view of one engine: occupancy gauges and the prefix cache's counters (torch-free:
it reads the engine's ``stats()`` only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_ENGINE_GAUGES = {
    "running": "tierserve_num_requests_running",
    "waiting": "tierserve_num_requests_waiting",
    "kv_pages_used": "tierserve_kv_pages_used",
    "kv_pages_cached": "tierserve_kv_pages_cached",
    "kv_pages_total": "tierserve_kv_pages_total",
    "reservations": "tierserve_reservations",
    "reservation_pages_quarantined": "tierserve_reservation_pages_quarantined",
    "reservation_staging_bytes": "tierserve_reservation_staging_bytes",
    "handoff_pages_parked": "tierserve_handoff_pages_parked",
}
_ENGINE_COUNTERS = {
    "preemptions": "tierserve_preemptions",
    "reservation_leases_expired": "tierserve_reservation_leases_expired",
}


class StatsSource(Protocol):
    """What the collector reads: ``EngineLoop.stats()`` (a snapshot the engine thread published),
    or ``Engine.stats()`` on the engine's own thread."""

    def stats(self) -> dict[str, float]: ...


class EngineCollector:
    """Exports one stats snapshot per scrape: occupancy gauges, and the prefix cache's ``cache_*``
    keys as ``tierserve_cache_*`` (keys ending in ``_total`` are counters); under CP the gather clock's
    ``cp_gather_*_seconds_total`` and the merge clock's ``cp_merge_*_total`` as ``tierserve_cp_*`` counters."""

    def __init__(self, engine: StatsSource) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for key, value in self.engine.stats().items():
            if key in _ENGINE_GAUGES:
                yield GaugeMetricFamily(_ENGINE_GAUGES[key], key.replace("_", " "), value=value)
            if key in _ENGINE_COUNTERS:
                yield CounterMetricFamily(_ENGINE_COUNTERS[key], key.replace("_", " "), value=value)
            if key.startswith(("cp_gather_", "cp_merge_")):  # CP's gather and merge clocks: counters
                yield CounterMetricFamily(f"tierserve_{key.removesuffix('_total')}", key.replace("_", " "), value=value)
            if not key.startswith("cache_"):
                continue
            name = f"tierserve_{key}"
            if key.endswith("_total"):
                yield CounterMetricFamily(name.removesuffix("_total"), key.replace("_", " "), value=value)
            else:
                yield GaugeMetricFamily(name, key.replace("_", " "), value=value)
