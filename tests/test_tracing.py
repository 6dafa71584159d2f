"""OpenTelemetry traces (docs/tracing.md, issue 34 item 1): the tracer against an in-process OTLP
receiver; tracing off loads no OpenTelemetry; the flags' checks; one ``tierserve serve`` request's
spans. Traces through a whole ``tierserve up`` cluster (router, prefill and decode nodes, a
migration) are in ``test_observability.py``, on the cluster its other checks read."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.otlp_receiver import ERROR, Receiver, one, otlp_receiver, spans_of
from helpers.processes import ServeProcess

from tierserve.tracing import NO_SPAN, SpanKind, TracingConfig, start_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between the exporter's batches: spans arrive at once
REPO = Path(__file__).resolve().parents[1]
TIER_KEYS = {f"tierserve.cached_tokens.{t}" for t in ("device", "host", "storage")}


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as r:
        yield r


def test_spans_reach_the_collector_under_the_callers_traceparent(receiver: Receiver, monkeypatch) -> None:
    """A server span continues the caller's trace; a child's ``headers`` continue it in the next
    process; a span recorded after the fact keeps its monotonic times; a failure is an error status."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracer = start_tracing(TracingConfig(receiver.endpoint), "svc", "host:1")
    started = time.monotonic()
    with tracer.server("call", {"traceparent": TRACEPARENT}, {"tierserve.request_id": "r1"}) as call:
        child = call.child("out", SpanKind.CLIENT)
        remote = tracer.server("remote", child.headers())  # as the next process gets it in gRPC metadata
        remote.record("done-before", started, started + 0.25, {"tierserve.cached_tokens.host": 16})
        remote.fail("broken")
        remote.end()
        child.end()
    spans = {s.name: s for s in spans_of(receiver, TRACE_ID, {"call", "out", "remote", "done-before"})}
    assert spans["call"].parent == CLIENT_SPAN and spans["call"].attrs["tierserve.request_id"] == "r1"
    assert spans["out"].parent == spans["call"].span_id and spans["remote"].parent == spans["out"].span_id
    assert spans["done-before"].parent == spans["remote"].span_id
    assert spans["done-before"].end_ns - spans["done-before"].start_ns == pytest.approx(0.25e9, abs=1e6)
    assert spans["done-before"].attrs == {"tierserve.cached_tokens.host": 16}
    assert spans["remote"].status == ERROR and spans["call"].status != ERROR
    assert spans["call"].resource["service.name"] == "svc" and spans["call"].resource["service.instance.id"] == "host:1"


def test_sampling_keeps_the_ratio_of_new_traces_and_follows_a_caller(receiver: Receiver, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracer = start_tracing(TracingConfig(receiver.endpoint, sample_ratio=0.0), "svc")
    unsampled = f"00-{'1' * 32}-{CLIENT_SPAN}-00"
    assert not tracer.server("new", {}).recording  # ratio 0: a new trace is dropped
    assert not tracer.server("declined", {"traceparent": unsampled}).recording
    with tracer.server("kept", {"traceparent": TRACEPARENT}) as kept:  # the caller sampled it: kept at ratio 0
        assert kept.recording
    assert [s.name for s in spans_of(receiver, TRACE_ID, {"kept"})] == ["kept"]


PROBE = """
import sys
import tierserve.api.app, tierserve.api.engine_backend, tierserve.router.app, tierserve.cli.main
from tierserve.cli.main import build_parser
from tierserve.tracing import NO_TRACER, TracingConfig, start_tracing
args = build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2"])
from tierserve.cli.flags import tracing_config
assert start_tracing(tracing_config(args), "x") is NO_TRACER
sdk = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "tierserve.tracing.otel")
print(sorted(m for m in sys.modules if m.startswith(sdk)) or "CLEAN")
"""


def test_tracing_off_loads_no_opentelemetry_sdk() -> None:
    """FastAPI itself imports the OpenTelemetry API; the SDK, its exporter and our spans over them
    load only with an endpoint."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "CLEAN"
    assert not NO_SPAN.recording and NO_SPAN.headers() == [] and NO_SPAN.child("x") is NO_SPAN


@pytest.mark.parametrize(("flags", "message"), [
    (["--otlp-traces-endpoint", "localhost"], "must be host:port or http(s)://host:port"),
    (["--otlp-traces-endpoint", "ftp://h:1"], "must be host:port or http(s)://host:port"),
    (["--otlp-traces-sample-ratio", "1.5"], "must be in [0, 1]"),
])
def test_bad_tracing_flags_are_usage_errors(flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tierserve.cli", "router", *flags], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    with pytest.raises(ValueError, match="sample-ratio"):
        TracingConfig("h:1", sample_ratio=-0.1)


@pytest.mark.integration
def test_serve_traces_a_request_through_its_engine(tiny_llama: Path, receiver: Receiver, tmp_path: Path,
                                                   monkeypatch) -> None:
    """``tierserve serve``: the response's span under the client's, the choice under it, and the
    engine's queue, prefix match (tier split), compute and decode under the choice."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the server inherits the test's environment
    server = ServeProcess(["--model", str(tiny_llama), "--device", "cpu", "--max-total-tokens", "1024",
                           "--otlp-traces-endpoint", receiver.endpoint], tmp_path / "serve.log").wait_ready()
    try:
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        engine = {"tierserve.queue", "tierserve.prefix_match", "tierserve.prefill_compute", "tierserve.decode"}
        spans = spans_of(receiver, TRACE_ID, engine | {"POST /v1/completions", "tierserve.choice"})
    finally:
        server.stop()
    assert {s.service for s in spans} == {"tierserve"}
    http, choice = one(spans, "POST /v1/completions"), one(spans, "tierserve.choice")
    assert http.parent == CLIENT_SPAN and choice.parent == http.span_id
    assert {one(spans, name).parent for name in engine} == {choice.span_id}
    assert set(one(spans, "tierserve.prefix_match").attrs) >= TIER_KEYS
    assert one(spans, "tierserve.decode").attrs["tierserve.completion_tokens"] == 3
