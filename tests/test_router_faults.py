"""Faults through the router with real processes: a prefill node killed mid-request (retried on
another pair, succeeds), every decode node down (503 at once, recovery when one returns), a node
restarted at its address between two health checks (identified again)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, load
from helpers.polling import wait_for
from helpers.processes import NodeProcess, RouterProcess, free_port

from tierserve.launch import http_ok
from tierserve.router.registry import Registry, WorkerState
from tierserve.router.roles import Role

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ADMIN = {"Authorization": "Bearer k"}


def complete(router: RouterProcess, prompt: list[int], max_tokens: int = 12) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)


def node(role: str, model: Path, log: Path, *extra: str, port: int | None = None) -> NodeProcess:
    args = DECODE_ARGS if role == "decode" else NODE_ARGS
    return NodeProcess(role, ["--model", str(model), *args, *extra], log, port=port)


@pytest.fixture(scope="module")
def prefill(long_llama: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    """A plain prefill node the tests share (none kills it; each start spends seconds): the spare
    of the first test, the prefill node of the others."""
    shared = node("prefill", long_llama, tmp_path_factory.mktemp("prefill") / "p.log")
    try:
        yield shared.wait_ready()
    finally:
        shared.stop()


def test_prefill_killed_mid_request_is_retried_on_another_node(long_llama: Path, prefill: NodeProcess,
                                                               tmp_path: Path) -> None:
    victim = node("prefill", long_llama, tmp_path / "victim.log", "--chunked-prefill-size", "16").wait_ready()
    spare = prefill
    decode = node("decode", long_llama, tmp_path / "decode.log").wait_ready()
    router = RouterProcess(["--model", str(long_llama), "--prefill", victim.address, "--decode", decode.address,
                            "--admin-api-key", "k", "--health-check-interval", "0.5"], tmp_path / "r.log").wait_ready()
    prompt = [2 + (i * 5) % 380 for i in range(1800)]
    try:
        responses: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: responses.append(complete(router, prompt)))
        thread.start()
        wait_for(lambda: _running(victim.address), "the victim prefills the request", 30)
        added = httpx.post(f"{router.url}/workers", json={"role": "prefill", "address": spare.address}, headers=ADMIN)
        assert added.json()["state"] == "healthy"
        victim.signal(signal.SIGKILL)
        thread.join(120)
        assert responses and responses[0].status_code == 200, responses[0].text if responses else "no answer"
        assert responses[0].json()["usage"]["completion_tokens"] == 12
        assert httpx.get(f"{router.url}/debug/state", headers=ADMIN).json()["retries"] >= 1
        wait_for(lambda: _clean(decode.address), "the decode node frees the dead attempt's pages", 20)
    finally:
        for proc in (router, victim, decode):
            proc.stop()


def test_a_restart_between_two_health_checks_is_identified_again(long_llama: Path, tmp_path: Path) -> None:
    """Another process at a worker's address, started before the router's next health check (the
    router never saw the address down): that check identifies it again, and its other page size
    gets it refused. Before, the router kept the first process's ``NodeInfo`` for good."""
    port = free_port()
    first = node("decode", long_llama, tmp_path / "first.log", port=port).wait_ready()

    async def run() -> None:
        registry = Registry(check_interval_s=3600)
        worker = registry.add(Role.DECODE, first.address)
        await registry.check(worker)
        assert worker.state is WorkerState.HEALTHY
        first.stop()
        second = node("decode", long_llama, tmp_path / "second.log", "--page-size", "32", port=port).wait_ready()
        try:
            await registry.check(worker)
            assert worker.state is WorkerState.REFUSED and "namespace" in worker.reason
            assert worker.info is not None and worker.info.identity.page_size == 32
        finally:
            second.stop()
            await registry.close()

    try:
        asyncio.run(run())
    finally:
        first.stop()


def test_all_decode_nodes_down_gives_503_quickly_and_recovers(long_llama: Path, prefill: NodeProcess,
                                                              tmp_path: Path) -> None:
    decode = node("decode", long_llama, tmp_path / "d.log").wait_ready()
    router = RouterProcess(["--model", str(long_llama), "--prefill", prefill.address, "--decode", decode.address,
                            "--health-check-interval", "0.5"], tmp_path / "r.log").wait_ready()
    prompt = [2 + i % 300 for i in range(40)]
    revived = None
    try:
        assert complete(router, prompt).status_code == 200
        decode.signal(signal.SIGKILL)
        decode.proc.wait(10)
        start = time.monotonic()
        r = complete(router, prompt)
        assert r.status_code == 503, r.text
        assert time.monotonic() - start < 5
        assert r.json()["error"]["message"]
        revived = node("decode", long_llama, tmp_path / "d2.log", port=decode.port).wait_ready()
        wait_for(lambda: http_ok(f"{router.url}/readiness"), "the router sees the decode node again", 30)
        r = complete(router, prompt)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    finally:
        for proc in (router, decode, revived):
            if proc is not None:
                proc.stop()


async def _running(address: str) -> bool:
    return (await load(address)).running > 0


async def _clean(address: str) -> bool:
    report = await load(address)
    return report.kv_pages_used == 0 and report.reservations == 0


def test_a_burst_bigger_than_the_decode_pool_waits_instead_of_failing(long_llama: Path, prefill: NodeProcess,
                                                                      tmp_path: Path) -> None:
    small = ["--model", str(long_llama), *DECODE_ARGS, "--max-total-tokens", "512"]  # room for two at a time
    decode = NodeProcess("decode", small, tmp_path / "d.log").wait_ready()
    router = RouterProcess(["--model", str(long_llama), "--prefill", prefill.address, "--decode", decode.address],
                           tmp_path / "r.log").wait_ready()
    try:
        prompts = [[2 + (i * 7 + j) % 380 for j in range(200)] for i in range(5)]
        with ThreadPoolExecutor(5) as pool:
            codes = list(pool.map(lambda p: complete(router, p).status_code, prompts))
        assert codes == [200] * 5
        assert httpx.get(f"{router.url}/debug/state").json()["retries"] >= 1  # some had to wait
    finally:
        for proc in (router, decode):
            proc.stop()
