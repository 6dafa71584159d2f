"""Priorities and deadlines through the real router and real nodes on the built-in model: bad
values are 400s; a request whose deadline its predicted first token cannot meet is answered 429
with Retry-After at once, never routed; the priority reaches the decode node, whose ``priority``
scheduler runs the more important of two waiting requests first, and the deadline reaches it too
(its late first tokens); the router's shed and late counters count. A second router over the same
nodes predicts from the node's reported backlog: the first router's queued work makes it shed a
request it admits once that work is gone."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import NODE_ARGS, load, metric, node_metric
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess, free_port, router_over_pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# The decode node runs one request at a time, most important first: the order waiting requests
# leave its queue is the order they finish.
DECODE_ARGS = [*NODE_ARGS, "--schedule-policy", "priority", "--max-running-requests", "1"]
SHORT = 8  # prompt tokens: under the disaggregation threshold, the decode node computes them (GenerateLocal)
LOCAL, QUEUED = 20, 6  # still under it; router A queues this many such requests behind a long one


@pytest.fixture(scope="module")
def cluster(builtin_model: Path, tmp_path_factory) -> Iterator[tuple[RouterProcess, NodeProcess, NodeProcess]]:
    with router_over_pair(builtin_model, [*NODE_ARGS, "--schedule-policy", "priority"],
                          [*DECODE_ARGS, "--metrics-port", str(free_port())],
                          ["--disaggregation-threshold", "24", "--admission", "ttft"],
                          tmp_path_factory.mktemp("priority")) as cluster:
        yield cluster


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 384) for _ in range(n)]


def complete(router: RouterProcess, prompt: list[int], headers: dict | None = None, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{router.url}/v1/completions", json=body, headers=headers or {}, timeout=120)


@pytest.mark.parametrize(("fields", "headers", "param"), [
    ({"priority": "1"}, {}, "priority"),
    ({"priority": 1.5}, {}, "priority"),
    ({"priority": 2**31}, {}, None),
    ({}, {"x-request-deadline-ms": "-5"}, "x-request-deadline-ms"),
    ({}, {"x-request-deadline-ms": "0"}, "x-request-deadline-ms"),
    ({}, {"x-request-deadline-ms": "soon"}, "x-request-deadline-ms"),
    ({}, {"x-request-deadline-ms": "1.5"}, "x-request-deadline-ms"),
])
def test_bad_priorities_and_deadlines_are_400(cluster, fields: dict, headers: dict, param: str | None) -> None:
    r = complete(cluster[0], _prompt(SHORT, 1), headers, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_an_impossible_deadline_is_answered_429_at_once_and_never_routed(cluster) -> None:
    router, _, _ = cluster
    assert complete(router, _prompt(200, 2)).status_code == 200  # through the prefill node: its rate is measured
    wait_for(lambda: _lanes(router), "a measured prefill rate", 30)
    routes, shed = _routes(router), metric(router, "tierserve_requests_shed_total", reason="deadline", priority="3")
    started = time.monotonic()
    r = complete(router, _prompt(200, 3), {"x-request-deadline-ms": "1"}, priority=3)
    elapsed = time.monotonic() - started
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "deadline" and int(r.headers["retry-after"]) >= 1
    assert elapsed < 5  # at once: no queueing, no compute (a 200-token prefill is not what took the time)
    assert _routes(router) == routes  # it reached no node
    assert metric(router, "tierserve_requests_shed_total", reason="deadline", priority="3") == shed + 1
    ok = complete(router, _prompt(200, 4), {"x-request-deadline-ms": "600000"}, priority=3)
    assert ok.status_code == 200 and metric(router, "tierserve_requests_on_time_total", priority="3") >= 1


def test_priority_and_deadline_reach_the_decode_node(cluster) -> None:
    """The decode node runs one request at a time: a long one runs while a less important request
    (its deadline 1 s, which it will miss there) and then a more important one queue behind it;
    once the long one is cancelled, the more important one runs first."""
    router, _, decode = cluster
    late = node_metric(decode, "tierserve_late_first_tokens_total")
    router_late = metric(router, "tierserve_requests_late_total", priority="5")
    stop, done = threading.Event(), {}
    hog = threading.Thread(target=_stream_until, args=(router, stop), daemon=True)
    hog.start()
    try:
        wait_for(lambda: _decode_load(decode, running=1, waiting=0), "the long request runs", 60)
        low = _finish_in_thread(router, "low", 21, {"priority": 5}, {"x-request-deadline-ms": "1000"}, done)
        wait_for(lambda: _decode_load(decode, running=1, waiting=1), "the less important one waits", 60)
        high = _finish_in_thread(router, "high", 22, {"priority": 0}, {}, done)
        wait_for(lambda: _decode_load(decode, running=1, waiting=2), "both wait", 60)
        time.sleep(1.0)  # the less important request's 1 s deadline passes while it waits (the point of the test)
    finally:
        stop.set()
    for thread in (hog, low, high):
        thread.join(120)
    assert {k: v[1] for k, v in done.items()} == {"low": 200, "high": 200}
    assert done["high"][0] < done["low"][0]  # the more important one finished first, though it came later
    assert node_metric(decode, "tierserve_late_first_tokens_total") == late + 1
    assert metric(router, "tierserve_requests_late_total", priority="5") == router_late + 1


def test_a_second_router_counts_the_first_routers_work_on_the_node_in_its_admission(cluster, builtin_model: Path,
                                                                                  tmp_path: Path) -> None:
    """Router B never sent the queued work (router A did): it sees it in the decode node's reported
    prefill backlog, and sheds a request whose deadline its own tokens alone would meet."""
    router_a, prefill, decode = cluster
    b = RouterProcess(["--model", str(builtin_model), "--prefill", prefill.address, "--decode", decode.address,
                       "--disaggregation-threshold", "24", "--admission", "ttft"], tmp_path / "router-b.log")
    stop, done, queued = threading.Event(), {}, []
    hog = threading.Thread(target=_stream_until, args=(router_a, stop), daemon=True)
    try:
        b.wait_ready()
        assert complete(b, _prompt(LOCAL, 40)).status_code == 200  # computed on the decode node: B measures it
        wait_for(lambda: _lane(b, decode)["rate"], "router B's rate for the decode node", 30)
        rate = _lane(b, decode)["rate"]
        deadline_ms = math.ceil(2.5 * 1000 * LOCAL / rate)  # its own tokens alone: 2.5x within it
        assert (QUEUED + 1) * LOCAL / rate * 1000 > deadline_ms  # behind the queued work: past it
        hog.start()
        wait_for(lambda: _decode_load(decode, running=1, waiting=0), "the long request runs", 60)
        queued = [_finish_in_thread(router_a, f"q{i}", 41 + i, {}, {}, done, LOCAL) for i in range(QUEUED)]
        wait_for(lambda: _decode_load(decode, running=1, waiting=QUEUED), "router A's requests queue", 60)
        wait_for(lambda: _lane(b, decode)["work_ahead"] >= QUEUED * LOCAL, "router B sees them", 30)
        r = complete(b, _prompt(LOCAL, 50), {"x-request-deadline-ms": str(deadline_ms)})
        assert r.status_code == 429 and r.json()["error"]["code"] == "deadline", r.text
    finally:
        stop.set()
        for thread in (hog, *queued):
            if thread.is_alive():
                thread.join(120)
        try:
            assert all(status == 200 for _, status, _ in done.values()) and len(done) == QUEUED
            wait_for(lambda: _lane(b, decode)["work_ahead"] == 0, "the backlog drained in router B's view", 30)
            assert _lane(b, decode)["rate"] == rate  # the shed request measured nothing
            ok = complete(b, _prompt(LOCAL, 51), {"x-request-deadline-ms": str(deadline_ms)})
            assert ok.status_code == 200, ok.text  # the same deadline, nothing queued: admitted
        finally:
            b.stop()


def _lane(router: RouterProcess, node: NodeProcess) -> dict:
    return httpx.get(f"{router.url}/debug/state").json()["lanes"].get(node.address, {"rate": None})


def _stream_until(router: RouterProcess, stop: threading.Event) -> None:
    """A long streaming request, cancelled (the client goes) once ``stop`` is set."""
    body = {"prompt": _prompt(SHORT, 10), "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                return


def _finish_in_thread(router: RouterProcess, name: str, seed: int, fields: dict, headers: dict,
                      done: dict[str, tuple], length: int = SHORT) -> threading.Thread:
    """``done[name]``: (when it finished, its status, its text or None)."""
    def run() -> None:
        r = complete(router, _prompt(length, seed), headers, max_tokens=8, **fields)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        done[name] = (time.monotonic(), r.status_code, text)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def _decode_load(decode: NodeProcess, running: int, waiting: int) -> bool:
    report = await load(decode.address)
    return report.running == running and report.waiting == waiting


def _routes(router: RouterProcess) -> int:
    return len(httpx.get(f"{router.url}/debug/state").json()["routes"])


def _lanes(router: RouterProcess) -> bool:
    return any(lane["rate"] for lane in httpx.get(f"{router.url}/debug/state").json()["lanes"].values())


def test_an_important_prompt_is_prefilled_on_the_decode_node_while_the_prefill_node_is_backed_up(
        cluster, builtin_model: Path, tmp_path: Path) -> None:
    """Router C spills priority 0 (``--disaggregation-spill-priority 0``): behind a long important
    prompt on the prefill node, a less important one still goes there, while the next important one
    is prefilled on the idle decode node, with the tokens the PD path gives it."""
    _, prefill, decode = cluster
    c = RouterProcess(["--model", str(builtin_model), "--prefill", prefill.address, "--decode", decode.address,
                       "--disaggregation-threshold", "24", "--admission", "ttft",
                       "--disaggregation-spill-priority", "0"], tmp_path / "router-c.log")
    done: dict[str, tuple] = {}
    try:
        c.wait_ready()
        # the PD path's tokens (C measures the prefill node's rate), in a cache namespace of their own: the
        # spilled request finds nothing cached
        reference = complete(c, _prompt(200, 63), max_tokens=8, cache_salt="reference").json()
        wait_for(lambda: _lane(c, prefill)["rate"], "router C's rate for the prefill node", 30)
        threads = []
        for name, seed, priority, length in [("long", 61, 0, 800), ("low", 62, 5, 200), ("spilled", 63, 0, 200)]:
            routed = _routes(c)  # one at a time, each routed before the next is sent
            threads.append(_finish_in_thread(c, name, seed, {"priority": priority}, {}, done, length))
            wait_for(lambda routed=routed: _routes(c) > routed, f"{name} routed", 30)
        for thread in threads:
            thread.join(120)
        routes = httpx.get(f"{c.url}/debug/state").json()["routes"]
        assert [(r["path"], r.get("spilled", False)) for r in routes] == [
            ("prefill_decode", False), ("prefill_decode", False), ("prefill_decode", False), ("decode_only", True)]
        assert {name: status for name, (_, status, _) in done.items()} == dict.fromkeys(("long", "low", "spilled"), 200)
        assert done["spilled"][2] == reference["choices"][0]["text"]
        assert metric(c, "tierserve_router_spilled_total") == 1
    finally:
        c.stop()
