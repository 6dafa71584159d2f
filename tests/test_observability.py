"""What an operator reads, on one ``tierserve up`` cluster (L3 on Mooncake, the built-in model, one
prefill and two decode nodes, traces sent to an in-process OTLP receiver): every metric the Grafana
dashboard queries exists on the router's and nodes' ``/metrics``; ``tierserve bench
--scrape-metrics`` puts the servers' own figures beside the client's; ``up``'s output at the default
log level carries no Mooncake noise (``test_up.py`` shows it at ``--log-level debug``); one PD
request with a client's ``traceparent`` is one trace whose spans come from the router, the prefill
node and the decode node, nested as the calls were, with the tier split of its cached tokens; a
request whose decode node dies mid-stream shows the migration between its tries (last: it kills a
node). One cluster for all of them: each start of it costs the suite half a minute."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import dashboard
from helpers.metrics import find, scrape
from helpers.otlp_receiver import ERROR, Receiver, by_name, one, otlp_receiver, spans_of
from helpers.polling import wait_for
from helpers.processes import free_port, running_up

from tierserve.bench.report import Report
from tierserve.cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MASTER_REPORT_S = 10  # mooncake_master's metrics dump interval at INFO
PROMPT = [1000 + (i * 37) % 40000 for i in range(200)]  # 12 pages: a repeat of it hits the prefill node's L1
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between the exporter's batches: spans arrive at once
ADMIN = {"Authorization": "Bearer adm"}
ROUTER, PREFILL, DECODE = "tierserve-router", "tierserve-prefill", "tierserve-decode"


class Cluster:
    """``tierserve up`` (1 prefill node, 2 decode nodes, L3) sending its traces to ``receiver``."""

    def __init__(self, port: int, lines: list[str], state: Path, receiver: Receiver) -> None:
        self.url, self.lines, self.state, self.receiver = f"http://127.0.0.1:{port}", lines, state, receiver
        self.up_at = time.monotonic()

    def node_metrics_urls(self) -> list[str]:
        """The prefill and decode nodes' /metrics (the state file names them)."""
        children = json.loads(self.state.read_text())["children"]
        return [c["metrics_url"] for c in children if c["role"] in ("prefill", "decode")]

    def complete(self, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def completion(self, prompt: str, trace_id: str, **body: object) -> dict:
        headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
        reply = httpx.post(f"{self.url}/v1/completions", json={"prompt": prompt, "temperature": 0, **body},
                           headers=headers, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def pid_of(self, address: str) -> int:
        port = int(address.rsplit(":", 1)[1])
        children = json.loads(self.state.read_text())["children"]
        return next(c["pid"] for c in children if c["grpc_port"] == port)

    def last_route(self) -> dict:
        return httpx.get(f"{self.url}/debug/state", headers=ADMIN, timeout=10).json()["routes"][-1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("up") / "state.json"
    port = free_port()
    with otlp_receiver() as receiver, running_up(
            port, "--decode-nodes", "2", "--max-total-tokens", "4096", "--admin-api-key", "adm", "--state-file",
            str(state), "--otlp-traces-endpoint", receiver.endpoint, "--otlp-traces-sample-ratio", "1.0",
            env=FAST_EXPORT) as lines:
        yield Cluster(port, lines, state, receiver)


def test_every_metric_the_dashboard_queries_is_exported_by_the_router_or_a_node(cluster: Cluster) -> None:
    for _ in range(2):  # a repeated prompt: handoffs, cache hits and the latency histograms all count
        cluster.complete(PROMPT)
    texts = [scrape(cluster.url)] + [httpx.get(u, timeout=10).text for u in cluster.node_metrics_urls()]
    exported = set().union(*map(dashboard.exported, texts))
    queried = dashboard.dashboard_metrics(dashboard.load())
    assert len(queried) >= 40 and all(name.startswith("tierserve_") for name in queried), sorted(queried)
    assert not queried - exported, f"the dashboard queries metrics nobody exports: {sorted(queried - exported)}"
    # not vacuous: a renamed metric in a query is caught
    renamed = json.loads(json.dumps(dashboard.load()).replace("tierserve_transfer_bytes_total",
                                                              "tierserve_transfer_byte_total"))
    assert dashboard.dashboard_metrics(renamed) - exported == {"tierserve_transfer_byte_total"}


def test_the_router_and_every_node_froze_their_startup_heap(cluster: Cluster) -> None:
    """docs/architecture.md, the collector: a full pass over a process's startup heap stalls it for
    ~150 ms, so each serving process freezes that heap when it becomes ready."""
    cluster.complete(PROMPT)
    for text in [scrape(cluster.url)] + [httpx.get(u, timeout=10).text for u in cluster.node_metrics_urls()]:
        frozen = find(text, "tierserve_gc_frozen_objects")
        assert frozen is not None and frozen > 50_000, frozen  # torch and the model alone are more than that
        assert find(text, "tierserve_gc_passes_total", generation="0") is not None


def test_bench_scrape_metrics_reports_the_servers_figures_beside_the_clients(cluster: Cluster, tmp_path: Path,
                                                                             capsys) -> None:
    """A shared-prefix run, one client at a time: the router counts the same prompt tokens the
    client sent, later prompts of a group hit the prefill node's device cache, each request was
    queued and handed off once."""
    out, plots = tmp_path / "run.json", tmp_path / "plots"
    args = ["bench", "run", "shared-prefix", "--endpoint", cluster.url, "--groups", "1", "--prompts-per-group", "4",
            "--system-length", "128", "--question-length", "16", "--output-length", "4", "--clients", "1",
            "--no-progress", "--out", str(out), "--plots-dir", str(plots), "--scrape-metrics",
            "--up-state", str(cluster.state)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "server view (4 /metrics" in printed and "node queue: mean" in printed, printed
    report = Report.from_json(out)
    client, server = report.summary(), report.server
    assert server is not None and len(server["sources"]) == 4
    assert server["requests"] == 4 and server["prompt_tokens"] == client["tokens"]["prompt"], (server, client)
    assert server["cached_tokens"]["device"] >= 3 * 128 * 0.9, server  # the shared system prompt, pages of it
    assert server["hit_rate"] == pytest.approx(client["hit_rate"]), (server, client)
    assert server["ttft_s"]["count"] == 4 and 0 < server["ttft_s"]["mean"] <= client["ttft_s"]["p99"] * 1.5
    assert server["queue_s"]["admitted"] >= 4 and server["queue_s"]["mean"] >= 0  # prefill + decode admissions
    assert server["handoff_s"]["count"] == 4 and server["handoff_bytes"] > 0, server
    assert server["l3_write_bytes"] > 0  # up backs every prompt up to L3 (Mooncake)
    assert (plots / "run_server.png").stat().st_size > 0  # the plots take --out's stem


def test_up_output_at_the_default_log_level_has_no_mooncake_noise(cluster: Cluster) -> None:
    """Before the migration test kills a node, and past the master's 10 s metrics-report interval (it
    reports at start too): the master's INFO lines and the nodes' known Mooncake noise are dropped, and uvicorn's
    start-up INFO lines; tierserve's own lines stay."""
    while time.monotonic() < cluster.up_at + MASTER_REPORT_S + 1:
        time.sleep(0.2)
    text = "".join(cluster.lines)
    assert "L3 on Mooncake" in text and "request" in text
    for noise in ("Master Admin Metrics", "Local segment descriptor not found", "InitGoogleLogging",
                  "segment_already_exists", "uvicorn.error"):
        assert noise not in text, noise
    assert "INFO tierserve." in text and "[prefill-0]" in text  # tierserve's own lines still show


NODE_SPANS = {"tierserve.v1.PrefillService/Prefill", "tierserve.v1.DecodeService/Reserve",
              "tierserve.v1.DecodeService/Generate"}
ENGINE_SPANS = {"tierserve.queue", "tierserve.prefix_match", "tierserve.prefill_compute", "tierserve.kv_handoff",
                "tierserve.decode_queue", "tierserve.first_token", "tierserve.decode"}
TIER_KEYS = {f"tierserve.cached_tokens.{t}" for t in ("device", "host", "storage")}


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
    def decode_spans() -> list:
        return [s for s in cluster.receiver.spans(trace_id) if s.service == DECODE]

    # the router's Generate span can arrive before the survivor's (each process exports on its own)
    wait_for(lambda: by_name(decode_spans(), "tierserve.v1.DecodeService/Generate"), "the survivor's Generate", 60)
    nodes = decode_spans()
    survivor = one(nodes, "tierserve.v1.DecodeService/Generate")  # the victim's never ended: it died
    assert survivor.resource["service.instance.id"] != f"127.0.0.1:{victim.rsplit(':', 1)[1]}"
    reserved_on = {s.resource["service.instance.id"] for s in by_name(nodes, "tierserve.v1.DecodeService/Reserve")}
    assert len(reserved_on) == 2 and survivor.resource["service.instance.id"] in reserved_on
