"""Prometheus metrics of the OpenAI-compatible HTTP API (torch-free: the router uses them)."""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from tierserve.core.gc_heap import GCCollector
from tierserve.core.outputs import RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.tiers import TIERS

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ApiMetrics:
    """Prometheus metrics of one HTTP server, in a registry of its own (no process-wide singletons);
    ``collectors`` add what the backend knows (engine occupancy, worker state)."""

    def __init__(self, *collectors: Any) -> None:
        self.registry = r = CollectorRegistry()

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.requests = Counter("tierserve_requests", "Choices that ran (produced output), by how they ended",
                                ["finish_reason"], registry=r)
        self.errors = Counter("tierserve_http_errors", "Error responses, by status and the error's code (why a "
                              "429 shed it: overloaded, tenant_limit; empty when the error has none)",
                              ["status", "code"], registry=r)
        self.prompt_tokens = Counter("tierserve_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("tierserve_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("tierserve_cached_tokens", "Prompt tokens from cache", ["tier"], registry=r)
        self.ttft = histogram("tierserve_time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("tierserve_inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("tierserve_e2e_request_latency_seconds", "Arrival to last token")
        self.shed = Counter("tierserve_requests_shed", "Requests answered 429 at admission, by reason "
                            "(deadline, queue_full, tenant_limit) and priority", ["reason", "priority"], registry=r)
        self.late = Counter("tierserve_requests_late", "Choices whose first token came after their deadline, by "
                            "priority", ["priority"], registry=r)
        self.on_time = Counter("tierserve_requests_on_time", "Choices with a deadline whose first token came "
                               "within it, by priority", ["priority"], registry=r)
        for collector in (GCCollector(), *collectors):
            r.register(collector)

    def first_token(self, params: SamplingParams, waited_s: float) -> None:
        """Counts a first token late or on time when its request has a deadline."""
        if params.deadline_ms is not None:
            late = waited_s * 1000 > params.deadline_ms
            (self.late if late else self.on_time).labels(str(params.priority)).inc()

    def request_ended(self, request_id: str, last: RequestOutput | None, failed: bool, started: float) -> None:
        """Counts one choice that ran, by how it ended (no finished output and no error: aborted),
        and logs it. A choice with no output (``last`` None) never started, or its client saw
        none of it: it is not a request here, its HTTP response is the error (so a fan-out
        rejected with 429 counts one HTTP error, not one per choice)."""
        e2e = time.monotonic() - started
        if last is None:
            log.debug("request %s ended before any output (failed=%s) after %.3fs", request_id, failed, e2e)
            return
        reason = "error" if failed else last.reason or "abort"
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(last.prompt_tokens)
        self.generation_tokens.inc(last.completion_tokens)
        for tier in TIERS:
            self.cached_tokens.labels(tier).inc(last.cached_by_tier.get(tier, 0))
        self.e2e.observe(e2e)
        log.info("request %s ended: reason=%s prompt=%d completion=%d cached=%d e2e=%.3fs", request_id, reason,
                 last.prompt_tokens, last.completion_tokens, last.cached_tokens, e2e)
