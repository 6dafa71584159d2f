"""OpenTelemetry traces (docs/tracing.md, issue 34 item 1): the tracer against an in-process OTLP
receiver; tracing off loads no OpenTelemetry; the flags' checks; and through a real ``tierserve up``
cluster, one PD request with a client's ``traceparent`` gives one trace whose spans come from the
router, the prefill node and the decode node, nested as the calls were, with the tier split of its
cached tokens; a request whose decode node dies mid-stream shows the migration between its tries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.otlp_receiver import ERROR, ReceivedSpan, Receiver, otlp_receiver
from helpers.polling import wait_for
from helpers.processes import ServeProcess, free_port, running_up

from tierserve.tracing import NO_SPAN, SpanKind, TracingConfig, start_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between the exporter's batches: spans arrive at once
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as r:
        yield r


def spans_of(receiver: Receiver, trace_id: str, names: set[str], deadline_s: float = 30.0) -> list[ReceivedSpan]:
    """The trace's spans once every one of ``names`` arrived."""
    wait_for(lambda: names <= {s.name for s in receiver.spans(trace_id)}, f"spans {sorted(names)}", deadline_s)
    return receiver.spans(trace_id)


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


# --- through a real cluster --------------------------------------------------------------------

ADMIN = {"Authorization": "Bearer adm"}
ROUTER, PREFILL, DECODE = "tierserve-router", "tierserve-prefill", "tierserve-decode"


class Cluster:
    """``tierserve up`` (1 prefill node, 2 decode nodes, L3) sending its traces to ``receiver``."""

    def __init__(self, receiver: Receiver, port: int, state_file: Path) -> None:
        self.receiver, self.url, self.state_file = receiver, f"http://127.0.0.1:{port}", state_file

    def completion(self, prompt: str, trace_id: str, **body: object) -> dict:
        headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
        reply = httpx.post(f"{self.url}/v1/completions", json={"prompt": prompt, "temperature": 0, **body},
                           headers=headers, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def pid_of(self, address: str) -> int:
        import json

        port = int(address.rsplit(":", 1)[1])
        children = json.loads(self.state_file.read_text())["children"]
        return next(c["pid"] for c in children if c["grpc_port"] == port)

    def last_route(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", headers=ADMIN, timeout=10).json()["routes"][-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("tracing") / "state.json"
    port = free_port()
    with otlp_receiver() as receiver, running_up(
            port, "--decode-nodes", "2", "--max-total-tokens", "4096", "--admin-api-key", "adm", "--state-file",
            str(state), "--otlp-traces-endpoint", receiver.endpoint, "--otlp-traces-sample-ratio", "1.0",
            env=FAST_EXPORT):
        yield Cluster(receiver, port, state)


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


NODE_SPANS = {"tierserve.v1.PrefillService/Prefill", "tierserve.v1.DecodeService/Reserve",
              "tierserve.v1.DecodeService/Generate"}
ENGINE_SPANS = {"tierserve.queue", "tierserve.prefix_match", "tierserve.prefill_compute", "tierserve.kv_handoff",
                "tierserve.decode_queue", "tierserve.first_token", "tierserve.decode"}
TIER_KEYS = {f"tierserve.cached_tokens.{t}" for t in ("device", "host", "storage")}


@pytest.mark.integration
@pytest.mark.slow
def test_a_pd_request_is_one_trace_across_router_prefill_and_decode(cluster: Cluster) -> None:
    """The same prompt twice (the second finds it cached on the prefill node): each request is one
    trace, the client's, whose spans come from the three services, each node's call a child of the
    router's call that carried its ``traceparent``, with the tier split of the cached tokens."""
    prompt = "Tracing follows one request through the router, the prefill node and the decode node. " * 6
    cluster.completion(prompt, "1" * 32, max_tokens=4)
    answer = cluster.completion(prompt, TRACE_ID, max_tokens=4)
    spans = spans_of(cluster.receiver, TRACE_ID, NODE_SPANS | ENGINE_SPANS | {"POST /v1/completions"})
    assert {s.trace_id for s in spans} == {TRACE_ID}
    assert {s.service for s in spans} == {ROUTER, PREFILL, DECODE}
    ids = {s.span_id: s for s in spans}
    http = one(spans, "POST /v1/completions")
    assert http.parent == CLIENT_SPAN and http.service == ROUTER and http.attrs["tierserve.request_id"] == answer["id"]
    choice = one(spans, "tierserve.choice")
    assert choice.parent == http.span_id and choice.attrs["tierserve.tenant"] == ""
    attempt = one(spans, "tierserve.attempt")
    assert attempt.parent == choice.span_id
    assert {one(spans, n).parent for n in ("tierserve.admission",)} == {choice.span_id}
    route = one(spans, "tierserve.route")
    assert route.parent == attempt.span_id and route.attrs["tierserve.path"] == "prefill_decode"
    assert {"tierserve.predicted_cached_tokens.prefill.device", "tierserve.predicted_cached_tokens.decode.host",
            "tierserve.prefill_node", "tierserve.decode_node"} <= set(route.attrs)
    nodes = [s for s in spans if s.service != ROUTER]
    for call in NODE_SPANS:  # the node's span is a child of the router's client span of that call
        server = one(nodes, call)
        client = ids[server.parent]
        assert client.name == call and client.service == ROUTER and client.parent == attempt.span_id, call
        assert server.attrs["tierserve.request_id"] == attempt.attrs["tierserve.request_id"] + "-1", call
    prefill = one(nodes, "tierserve.v1.PrefillService/Prefill")
    assert prefill.service == PREFILL and prefill.attrs["tierserve.tenant"] == ""
    for name in ("tierserve.queue", "tierserve.prefix_match", "tierserve.prefill_compute", "tierserve.kv_handoff"):
        assert one(spans, name).parent == prefill.span_id, name
    match = one(spans, "tierserve.prefix_match")
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert set(match.attrs) >= TIER_KEYS and set(attempt.attrs) >= TIER_KEYS
    assert match.attrs["tierserve.cached_tokens"] == attempt.attrs["tierserve.cached_tokens"] == cached > 0
    assert match.attrs["tierserve.cached_tokens.device"] == usage["cached_tokens_by_tier"]["device"] > 0
    handoff = one(spans, "tierserve.kv_handoff")
    assert handoff.attrs["tierserve.handoff.bytes"] > 0 and handoff.attrs["tierserve.handoff.exposed_seconds"] >= 0
    generate = one(nodes, "tierserve.v1.DecodeService/Generate")
    assert generate.service == DECODE and generate.attrs["tierserve.tenant"] == ""
    for name in ("tierserve.decode_queue", "tierserve.first_token", "tierserve.decode"):
        assert one(spans, name).parent == generate.span_id, name
    assert one(spans, "tierserve.decode").attrs["tierserve.completion_tokens"] == 4
    assert [s for s in spans if s.status == ERROR] == []
    assert all(s.start_ns <= s.end_ns for s in spans)
    assert http.start_ns <= prefill.start_ns <= generate.start_ns <= generate.end_ns <= http.end_ns
    first = spans_of(cluster.receiver, "1" * 32, {"tierserve.l3_prefetch_wait", "tierserve.queue"})
    wait = one(first, "tierserve.l3_prefetch_wait")  # its uncached pages went to L3 first (not there: computed)
    queue = one([s for s in first if s.service == PREFILL], "tierserve.queue")
    assert wait.parent == queue.span_id and queue.start_ns <= wait.start_ns <= wait.end_ns <= queue.end_ns


@pytest.mark.integration
@pytest.mark.slow
def test_a_migrated_request_shows_the_seam(cluster: Cluster) -> None:
    """Its decode node SIGKILLed mid-stream, a streaming request continues on the other decode
    node: its trace has the failed try, a ``tierserve.migration`` span naming the lost node, and the
    resumed try (on the other node) after it."""
    trace_id = "2" * 32
    body = {"prompt": "Count slowly: one, two, three,", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    received: list[str] = []
    status: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=300,
                          headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}) as reply:
            status.append(reply.status_code)
            received.extend(line for line in reply.iter_lines() if line.startswith("data: {"))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_for(lambda: len(received) >= 4, "4 streamed chunks", 120)
    victim = cluster.last_route()["decode"]
    os.kill(cluster.pid_of(victim), signal.SIGKILL)
    reader.join(300)
    assert status == [200] and '"finish_reason":"length"' in received[-1].replace(" ", ""), received[-2:]
    spans = spans_of(cluster.receiver, trace_id, {"tierserve.migration", "tierserve.v1.DecodeService/Generate",
                                                  "tierserve.choice", "POST /v1/completions"}, 60)
    choice = one(spans, "tierserve.choice")
    seam = one(spans, "tierserve.migration")
    assert seam.parent == choice.span_id and seam.attrs["tierserve.migration.from"] == victim
    assert seam.attrs["tierserve.migration.reason"] == "failed" and seam.attrs["tierserve.migration.generated"] >= 4
    attempts = sorted(by_name(spans, "tierserve.attempt"), key=lambda s: s.start_ns)
    lost, resumed = attempts[0], attempts[-1]
    assert lost.status == ERROR and resumed.status != ERROR and resumed.attrs["tierserve.request_id"].endswith("-m1")
    assert lost.start_ns <= seam.start_ns <= resumed.start_ns <= seam.end_ns <= resumed.end_ns
    nodes = [s for s in spans if s.service == DECODE]
    survivor = one(nodes, "tierserve.v1.DecodeService/Generate")  # the victim's never ended: it died
    assert survivor.resource["service.instance.id"] != f"127.0.0.1:{victim.rsplit(':', 1)[1]}"
    reserved_on = {s.resource["service.instance.id"] for s in by_name(nodes, "tierserve.v1.DecodeService/Reserve")}
    assert len(reserved_on) == 2 and survivor.resource["service.instance.id"] in reserved_on
