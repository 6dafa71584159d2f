"""``bench run --scrape-metrics`` without a cluster: the servers' figures from two ``/metrics``
texts, percentiles from buckets as Prometheus computes them, the URLs the flags name, and a wrong
URL refused before the run. ``test_observability.py`` runs it against a real cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tierserve.bench.server_metrics import parse, quantile, server_figures, server_lines
from tierserve.cli.bench import metrics_urls
from tierserve.cli.main import build_parser, main


def api_text(prompt: int, device: int, ttfts: list[float], queue_s: float = 0.0, admitted: int = 0) -> str:
    """A ``/metrics`` text of the names the figures read, with these totals."""
    r = CollectorRegistry()
    Counter("tierserve_requests", "", ["finish_reason"], registry=r).labels("length").inc(len(ttfts))
    Counter("tierserve_prompt_tokens", "", registry=r).inc(prompt)
    cached = Counter("tierserve_cached_tokens", "", ["tier"], registry=r)
    cached.labels("device").inc(device)
    cached.labels("host").inc(0)
    ttft = Histogram("tierserve_time_to_first_token_seconds", "", buckets=(0.1, 1.0), registry=r)
    for t in ttfts:
        ttft.observe(t)
    Counter("tierserve_queue_seconds", "", registry=r).inc(queue_s)
    Counter("tierserve_admitted_requests", "", registry=r).inc(admitted)
    return generate_latest(r).decode()


def test_figures_are_the_difference_of_the_two_scrapes_summed_over_servers() -> None:
    before = {"router": parse(api_text(100, 20, [0.05])), "node": parse(api_text(0, 0, [], 1.0, 2))}
    after = {"router": parse(api_text(400, 170, [0.05, 0.5, 0.5, 2.0])), "node": parse(api_text(0, 0, [], 1.6, 5))}
    s = server_figures(before, after)
    assert s["sources"] == ["node", "router"] and s["requests"] == 3 and s["prompt_tokens"] == 300
    assert s["hit_rate"] == pytest.approx(0.5) and s["hit_rate_by_tier"]["device"] == pytest.approx(0.5)
    assert s["hit_rate_by_tier"]["storage"] == 0
    assert s["ttft_s"]["count"] == 3 and s["ttft_s"]["mean"] == pytest.approx(1.0)
    assert s["queue_s"] == {"admitted": 3, "mean": pytest.approx(0.2)}
    assert s["handoff_s"] == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}  # no node sent KV
    text = "\n".join(server_lines(s))
    assert "hit rate: 50.0% of 300 prompt tokens (device 50.0%" in text and "mean 200.0 ms over 3" in text


def test_quantiles_interpolate_within_buckets_as_histogram_quantile_does() -> None:
    buckets = [(0.1, 1.0), (1.0, 3.0), (float("inf"), 4.0)]  # 1 under 0.1 s, 2 in (0.1, 1], 1 above
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)
    assert quantile(buckets, 0.25) == pytest.approx(0.1)
    assert quantile(buckets, 0.99) == 1.0  # in the +Inf bucket: the highest finite bound
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_the_flags_name_the_endpoints_metrics_then_the_nodes(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"children": [
        {"role": "mooncake_master", "metrics_url": "http://h:1/metrics"},
        {"role": "prefill", "metrics_url": "http://h:2/metrics"},
        {"role": "decode", "metrics_url": "http://h:3/metrics"},
        {"role": "router", "metrics_url": "http://h:8000/metrics"}]}))
    parser = build_parser()
    args = parser.parse_args(["bench", "run", "multiturn", "--endpoint", "http://h:8000/", "--scrape-metrics",
                              "--metrics-url", "http://h:9/metrics", "--up-state", str(state)])
    assert metrics_urls(args) == ("http://h:8000/metrics", "http://h:9/metrics", "http://h:2/metrics",
                                  "http://h:3/metrics")
    assert metrics_urls(parser.parse_args(["bench", "run", "multiturn"])) == ()
    with pytest.raises(ValueError, match="need --scrape-metrics"):
        metrics_urls(parser.parse_args(["bench", "run", "multiturn", "--metrics-url", "http://h:9/metrics"]))
    state.write_text("{}")
    with pytest.raises(ValueError, match="not a `tierserve up --state-file` file"):
        metrics_urls(args)


def test_an_unreachable_metrics_url_is_a_usage_error_before_any_request(capsys) -> None:
    code = main(["bench", "run", "shared-prefix", "--endpoint", "http://127.0.0.1:9", "--model", "m",
                 "--scrape-metrics", "--no-progress"])
    assert code == 2
    assert "--scrape-metrics: cannot read http://127.0.0.1:9/metrics" in capsys.readouterr().err
