"""A fan-out (``n`` > 1) request through the router whose siblings are rejected at admission:
the choices already reserving on the decode node leave no reservation behind (issue 13 item 1),
and the metrics count one HTTP error, not one error per choice (item 9)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, load, metric
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SLOTS = 8  # the router runs this many choices at once and queues none: the rest of an n=16 get 429


@pytest.fixture(scope="module")
def cluster(long_llama: Path, tmp_path_factory) -> Iterator[tuple[RouterProcess, NodeProcess]]:
    logs = tmp_path_factory.mktemp("fanout")
    prefill = NodeProcess("prefill", ["--model", str(long_llama), *NODE_ARGS], logs / "p.log")
    decode = NodeProcess("decode", ["--model", str(long_llama), *DECODE_ARGS], logs / "d.log")
    router = None
    try:
        prefill.wait_ready(), decode.wait_ready()
        router = RouterProcess(["--model", str(long_llama), "--prefill", prefill.address, "--decode", decode.address,
                                "--max-running-requests", str(SLOTS), "--max-queued-requests", "0"],
                               logs / "r.log").wait_ready()
        yield router, decode
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()


def fan_out(router: RouterProcess, n: int) -> httpx.Response:
    body = {"prompt": [2 + i % 300 for i in range(300)], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": n}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)


async def _no_reservations(address: str) -> bool:
    report = await load(address)
    return report.reservations == 0 and report.kv_pages_used == 0


def test_a_fan_out_rejected_with_429_leaves_no_reservation_on_the_decode_node(cluster) -> None:
    router, decode = cluster
    for _ in range(3):  # the race (a choice cancelled while its Reserve is in flight) is hit most times
        r = fan_out(router, 2 * SLOTS)
        assert r.status_code == 429, r.text
        # The lease would keep an orphan for 600 s (the router's prefill timeout) plus the grace.
        wait_for(lambda: _no_reservations(decode.address), "the decode node holds no reservation", 10)


def test_a_fan_out_rejected_with_429_counts_one_http_error_and_no_request(cluster) -> None:
    router, _ = cluster
    errors, aborts = metric(router, "tierserve_requests_total", finish_reason="error"), \
        metric(router, "tierserve_requests_total", finish_reason="abort")
    rejected = metric(router, "tierserve_http_errors_total", status="429")
    assert fan_out(router, 2 * SLOTS).status_code == 429
    assert metric(router, "tierserve_http_errors_total", status="429") == rejected + 1
    assert metric(router, "tierserve_requests_total", finish_reason="error") == errors  # no choice ran
    assert metric(router, "tierserve_requests_total", finish_reason="abort") == aborts
    finished = metric(router, "tierserve_requests_total", finish_reason="length")
    assert fan_out(router, 3).status_code == 200
    assert metric(router, "tierserve_requests_total", finish_reason="length") == finished + 3  # one per choice
