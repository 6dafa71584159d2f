"""Decode streams through the router with real processes (issue 13 items 5, 6, 7): a decode node
killed or frozen mid-generation, a decode worker removed mid-stream. A request that produced
tokens continues on another pair (migration, issue 17; tests/test_migration.py has the rest); a
stream that cannot go on (no other decode node) ends with an OpenAI-shaped error event and
``finish_reason: "error"``; a removed worker drains; every page comes back."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import load, metric
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess, node_running

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096"]
ADMIN = {"Authorization": "Bearer k"}
IDLE_S = 3.0  # the routers' --stream-idle-timeout here
LONG = 150  # tokens: several seconds of decoding on a CPU, a wide window to act in


@pytest.fixture(scope="module")
def prefill(builtin_model: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    log = tmp_path_factory.mktemp("p") / "p.log"
    with node_running("prefill", ["--model", str(builtin_model), *ARGS], log) as node:
        yield node


class DecodePool:
    """Decode nodes of the built-in model shared by the module's tests (each start loads the model
    for seconds): a test takes fresh or idle ones; those alive when its cluster stops come back once
    idle (a node a test killed does not), and the module stops them at its end."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs, self.idle, self.started = model, logs, [], 0

    def take(self, count: int) -> list[NodeProcess]:
        taken, self.idle = self.idle[:count], self.idle[count:]
        fresh = [self._start() for _ in range(count - len(taken))]
        return [*taken, *(node.wait_ready() for node in fresh)]

    def _start(self) -> NodeProcess:
        self.started += 1
        return NodeProcess("decode", ["--model", str(self.model), *ARGS], self.logs / f"d{self.started}.log")

    def give_back(self, nodes: list[NodeProcess]) -> None:
        """The nodes still running, once they hold no request, page or reservation."""
        for node in nodes:
            if node.proc.poll() is not None:
                continue
            node.signal(signal.SIGCONT)  # a test that failed may have left it frozen
            wait_for(lambda n=node: _idle(n.address), f"{node.address} holds nothing before the next test", 30)
            self.idle.append(node)

    def stop(self) -> None:
        for node in self.idle:
            node.stop()


@pytest.fixture(scope="module")
def decode_pool(builtin_model: Path, tmp_path_factory) -> Iterator[DecodePool]:
    pool = DecodePool(builtin_model, tmp_path_factory.mktemp("decodes"))
    yield pool
    pool.stop()


class Cluster:
    """The shared prefill node, decode nodes of the pool and a router over them."""

    def __init__(self, model: Path, prefill: NodeProcess, pool: DecodePool, logs: Path, decodes: int,
                 *router_args: str) -> None:
        self.pool, self.decodes = pool, pool.take(decodes)
        workers = [a for d in self.decodes for a in ("--decode", d.address)]
        self.router_log = logs / "router.log"
        self.router = RouterProcess(["--model", str(model), "--prefill", prefill.address, *workers,
                                     "--health-check-interval", "0.5", "--admin-api-key", "k", *router_args],
                                    self.router_log).wait_ready()

    def stop(self) -> None:
        self.router.stop()
        self.pool.give_back(self.decodes)

    def running_decode(self) -> NodeProcess:
        """The decode node that runs the (one) request in flight, once it does."""
        wait_for(lambda: any(_runs(d) for d in self.decodes), "a decode node runs the request", 60)
        return next(d for d in self.decodes if _runs(d))


def _runs(node: NodeProcess) -> bool:
    return asyncio.run(load(node.address)).running > 0


@pytest.fixture()
def cluster_factory(builtin_model: Path, prefill: NodeProcess, decode_pool: DecodePool, tmp_path: Path) -> Iterator:
    made: list[Cluster] = []

    def make(decodes: int, *router_args: str) -> Cluster:
        made.append(Cluster(builtin_model, prefill, decode_pool, tmp_path, decodes, *router_args))
        return made[-1]

    yield make
    for cluster in made:
        cluster.stop()


def body(stream: bool, max_tokens: int = LONG) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def post_in_thread(router: RouterProcess, stream: bool = False) -> tuple[threading.Thread, list[httpx.Response]]:
    replies: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: replies.append(
        httpx.post(f"{router.url}/v1/completions", json=body(stream), timeout=120)))
    thread.start()
    return thread, replies


def read_events(lines: Iterator[str], count: int | None = None) -> list[dict | str]:
    """The next ``count`` SSE data events (all when None), JSON decoded ("[DONE]" as is)."""
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
            if count is not None and len(out) == count:
                break
    return out


def assert_ends_with_an_error(events: list[dict | str]) -> None:
    """An OpenAI-shaped error event, a final chunk with finish_reason "error", then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["type"] == "server_error" and errors[0]["error"]["message"]
    finals = [e for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["error"], events[-3:]


async def _idle(address: str) -> bool:
    report = await load(address)
    return report.running == 0 and report.kv_pages_used == 0 and report.reservations == 0


def test_a_non_streaming_request_whose_decode_node_dies_continues_on_another_pair(cluster_factory) -> None:
    cluster = cluster_factory(2)
    thread, replies = post_in_thread(cluster.router)
    victim = cluster.running_decode()
    victim.signal(signal.SIGKILL)
    thread.join(120)
    assert replies and replies[0].status_code == 200, replies[0].text if replies else "no answer"
    answer = replies[0].json()
    assert answer["usage"]["completion_tokens"] == LONG
    again = httpx.post(f"{cluster.router.url}/v1/completions", json=body(False), timeout=120).json()
    assert answer["choices"][0]["text"] == again["choices"][0]["text"]  # the text runs on across the seam
    moves = [line for line in cluster.router_log.read_text().splitlines()
             if "WARNING" in line and "migrating" in line]
    assert len(moves) == 1 and victim.address in moves[0], moves  # once, with the node and the reason


def test_a_stream_whose_decode_node_dies_ends_with_an_error_event_and_finish_reason_error(cluster_factory) -> None:
    cluster = cluster_factory(1)
    errors = metric(cluster.router, "tierserve_requests_total", finish_reason="error")
    with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=body(True), timeout=60) as r:
        lines = r.iter_lines()
        events = read_events(lines, 3)
        cluster.decodes[0].signal(signal.SIGKILL)
        events += read_events(lines)
    assert r.status_code == 200
    assert_ends_with_an_error(events)
    assert metric(cluster.router, "tierserve_requests_total", finish_reason="error") == errors + 1


def test_a_stream_from_a_frozen_decode_node_ends_after_the_idle_timeout_and_its_pages_come_back(
        cluster_factory) -> None:
    cluster = cluster_factory(1, "--stream-idle-timeout", str(IDLE_S))
    frozen = cluster.decodes[0]
    try:
        with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=body(True),
                          timeout=httpx.Timeout(60, read=10 * IDLE_S)) as r:
            lines = r.iter_lines()
            events = read_events(lines, 3)
            frozen.signal(signal.SIGSTOP)
            events += read_events(lines)
        assert_ends_with_an_error(events)
    finally:
        frozen.signal(signal.SIGCONT)
    wait_for(lambda: _idle(frozen.address), "the thawed decode node frees the stream's pages", 30)


def test_a_non_streaming_request_on_a_frozen_decode_node_continues_on_another_pair(cluster_factory) -> None:
    cluster = cluster_factory(2, "--stream-idle-timeout", str(IDLE_S))
    thread, replies = post_in_thread(cluster.router)
    frozen = cluster.running_decode()
    frozen.signal(signal.SIGSTOP)
    try:
        thread.join(60)
        assert replies and replies[0].status_code == 200, replies[0].text if replies else "no answer in 60 s"
        assert replies[0].json()["usage"]["completion_tokens"] == LONG
        state = httpx.get(f"{cluster.router.url}/debug/state", headers={"Authorization": "Bearer k"}).json()
        assert state["migrations_by_reason"]["silent"] == 1, state  # it stopped answering: migrated
    finally:
        frozen.signal(signal.SIGCONT)
    wait_for(lambda: _idle(frozen.address), "the thawed decode node frees the abandoned try's pages", 30)


def test_a_removed_decode_worker_finishes_its_stream_and_gets_no_new_request(cluster_factory) -> None:
    cluster = cluster_factory(1)
    router, decode = cluster.router, cluster.decodes[0]
    worker = {"role": "decode", "address": decode.address}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body(True), timeout=60) as r:
        lines = r.iter_lines()
        events = read_events(lines, 3)
        assert httpx.request("DELETE", f"{router.url}/workers", json=worker, headers=ADMIN).status_code == 200
        assert _state(router, decode.address) == "draining"
        refused = httpx.post(f"{router.url}/v1/completions", json=body(False, 2), timeout=60)
        assert refused.status_code == 503, refused.text  # its only decode worker takes no new request
        events += read_events(lines)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: _state(router, decode.address) is None, "the drained worker leaves the registry", 10)


def _state(router: RouterProcess, address: str) -> str | None:
    workers = httpx.get(f"{router.url}/workers", headers=ADMIN).json()["workers"]
    return next((w["state"] for w in workers if w["role"] == "decode" and w["address"] == address), None)
