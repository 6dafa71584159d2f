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
    "priority_preemptions": "tierserve_priority_preemptions",
    "late_first_tokens": "tierserve_late_first_tokens",
    "prefill_tokens_computed": "tierserve_prefill_tokens_computed",
    "schedule_held_steps": "tierserve_schedule_held_steps",
    "admitted_requests": "tierserve_admitted_requests",  # with queue_seconds: the mean wait in the queue
    "queue_seconds": "tierserve_queue_seconds",
    "reservation_leases_expired": "tierserve_reservation_leases_expired",
    "spec_draft_tokens": "tierserve_spec_draft_tokens",
    "spec_accepted_tokens": "tierserve_spec_accepted_tokens",
    "spec_verify_steps": "tierserve_spec_verify_steps",
    "spec_prompt_catch_up_tokens": "tierserve_spec_prompt_catch_up_tokens",
    "spec_draft_split_steps": "tierserve_spec_draft_split_steps",
}


class StatsSource(Protocol):
    """What the collector reads: ``EngineLoop.stats()`` (a snapshot the engine thread published),
    or ``Engine.stats()`` on the engine's own thread."""

    def stats(self) -> dict[str, float]: ...


class EngineCollector:
    """Exports one stats snapshot per scrape: occupancy gauges, and the prefix cache's ``cache_*``
    keys as ``tierserve_cache_*`` (keys ending in ``_total`` are counters); under CP the gather clock's
    ``cp_gather_*_seconds_total``, the merge clock's ``cp_merge_*_total`` and the split clock's
    ``cp_split_*_total`` as ``tierserve_cp_*`` counters;
    with speculative decoding the draft counters and, from them, the acceptance rate and tokens per
    verification step."""

    def __init__(self, engine: StatsSource) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.stats()
        yield from _speculative(stats)
        for key, value in stats.items():
            if key in _ENGINE_GAUGES:
                yield GaugeMetricFamily(_ENGINE_GAUGES[key], key.replace("_", " "), value=value)
            if key in _ENGINE_COUNTERS:
                yield CounterMetricFamily(_ENGINE_COUNTERS[key], key.replace("_", " "), value=value)
            if key.startswith(("cp_gather_", "cp_merge_", "cp_split_")):  # CP's gather, merge, split clocks: counters
                yield CounterMetricFamily(f"tierserve_{key.removesuffix('_total')}", key.replace("_", " "), value=value)
            if not key.startswith("cache_"):
                continue
            name = f"tierserve_{key}"
            if key.endswith("_total"):
                yield CounterMetricFamily(name.removesuffix("_total"), key.replace("_", " "), value=value)
            else:
                yield GaugeMetricFamily(name, key.replace("_", " "), value=value)


def _speculative(stats: dict[str, float]) -> Iterator[GaugeMetricFamily]:
    """Acceptance rate (accepted / proposed draft tokens) and accepted tokens per verification
    step (the drafts kept plus the target's own token), since start; nothing without a draft."""
    steps, drafted = stats.get("spec_verify_steps"), stats.get("spec_draft_tokens")
    if steps is None or drafted is None:
        return
    accepted = stats.get("spec_accepted_tokens", 0)
    yield GaugeMetricFamily("tierserve_spec_acceptance_rate", "accepted / proposed draft tokens",
                            value=accepted / drafted if drafted else 0.0)
    yield GaugeMetricFamily("tierserve_spec_accepted_tokens_per_step", "tokens appended per verification step",
                            value=(accepted + steps) / steps if steps else 0.0)
