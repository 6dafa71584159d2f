"""What an operator reads, on one ``tierserve up`` cluster (L3 on Mooncake, the built-in model): every
metric the Grafana dashboard queries exists on the router's and nodes' ``/metrics``; ``tierserve
bench --scrape-metrics`` puts the servers' own figures beside the client's; and ``up``'s output at
the default log level carries no Mooncake noise (``test_up.py`` shows it at ``--log-level debug``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import dashboard
from helpers.metrics import scrape
from helpers.processes import free_port, running_up

from tierserve.bench.report import Report
from tierserve.cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MASTER_REPORT_S = 10  # mooncake_master's metrics dump interval at INFO
PROMPT = [1000 + (i * 37) % 40000 for i in range(200)]  # 12 pages: a repeat of it hits the prefill node's L1


class Cluster:
    def __init__(self, port: int, lines: list[str], state: Path) -> None:
        self.url, self.lines, self.state = f"http://127.0.0.1:{port}", lines, state
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    state = tmp_path_factory.mktemp("up") / "state.json"
    port = free_port()
    with running_up(port, "--max-total-tokens", "4096", "--state-file", str(state)) as lines:
        yield Cluster(port, lines, state)


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
    assert "server view (3 /metrics" in printed and "node queue: mean" in printed, printed
    report = Report.from_json(out)
    client, server = report.summary(), report.server
    assert server is not None and len(server["sources"]) == 3
    assert server["requests"] == 4 and server["prompt_tokens"] == client["tokens"]["prompt"], (server, client)
    assert server["cached_tokens"]["device"] >= 3 * 128 * 0.9, server  # the shared system prompt, pages of it
    assert server["hit_rate"] == pytest.approx(client["hit_rate"]), (server, client)
    assert server["ttft_s"]["count"] == 4 and 0 < server["ttft_s"]["mean"] <= client["ttft_s"]["p99"] * 1.5
    assert server["queue_s"]["admitted"] >= 4 and server["queue_s"]["mean"] >= 0  # prefill + decode admissions
    assert server["handoff_s"]["count"] == 4 and server["handoff_bytes"] > 0, server
    assert server["l3_write_bytes"] > 0  # up backs every prompt up to L3 (Mooncake)
    assert (plots / "run_server.png").stat().st_size > 0  # the plots take --out's stem


def test_up_output_at_the_default_log_level_has_no_mooncake_noise(cluster: Cluster) -> None:
    """Last in the module, and past the master's 10 s metrics-report interval (it reports at start
    too): the master's INFO lines and the nodes' known Mooncake noise are dropped, and uvicorn's
    start-up INFO lines; tierserve's own lines stay."""
    while time.monotonic() < cluster.up_at + MASTER_REPORT_S + 1:
        time.sleep(0.2)
    text = "".join(cluster.lines)
    assert "L3 on Mooncake" in text and "request" in text
    for noise in ("Master Admin Metrics", "Local segment descriptor not found", "InitGoogleLogging",
                  "segment_already_exists", "uvicorn.error"):
        assert noise not in text, noise
    assert "INFO tierserve." in text and "[prefill-0]" in text  # tierserve's own lines still show
