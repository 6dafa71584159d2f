"""Failures of a prefill/decode pair with real processes: a prefill node killed mid-handoff,
injected transfer failures, and a frozen decode node. Every request completes or fails with a
clear error within its deadline, the survivors stay healthy, and every page comes back."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.injected_faults import handoff_env
from helpers.pd_nodes import DECODE_ARGS, GRACE_S, NODE_ARGS, greedy, load, prompts, reference, reserve, run_pd
from helpers.polling import wait_for, wait_for_async
from helpers.processes import NodeProcess, node_running

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import pd_flow

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def decode(long_llama: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    log = tmp_path_factory.mktemp("d") / "d.log"
    with node_running("decode", ["--model", str(long_llama), *DECODE_ARGS], log) as node:
        yield node


@pytest.fixture(scope="module")
def plain_prefill(long_llama: Path, tmp_path_factory) -> Iterator[NodeProcess]:
    """A prefill node without faults, shared (none kills or freezes it; each start spends seconds)."""
    log = tmp_path_factory.mktemp("p") / "p.log"
    with node_running("prefill", ["--model", str(long_llama), *NODE_ARGS], log) as node:
        yield node


def start_prefill(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> NodeProcess:
    return NodeProcess("prefill", ["--model", str(model), *NODE_ARGS, *extra], log, env).wait_ready()


async def pages_back(address: str) -> bool:
    report = await load(address)
    return report.kv_pages_used == 0 and report.reservations == 0


def test_prefill_killed_mid_handoff_leaves_decode_healthy(long_llama: Path, decode: NodeProcess,
                                                          plain_prefill: NodeProcess, tmp_path: Path) -> None:
    victim = start_prefill(long_llama, tmp_path / "victim.log", "--chunked-prefill-size", "16")
    prompt = [2 + (i * 7) % 380 for i in range(1800)]  # ~110 prefill steps: a wide window to kill in
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            asyncio.run(run_pd(victim.address, decode.address, "victim", prompt))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: _running(victim.address), "the victim starts prefilling", 30)
    victim.signal(signal.SIGKILL)
    thread.join(timeout=30)
    assert isinstance(outcome[0], pd_flow.HandoffFailed), outcome
    assert outcome[0].code == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: pages_back(decode.address), "the decode node reclaims every page", GRACE_S + 15)

    survivor = plain_prefill
    batch = prompts(3, seed=11)
    got = [asyncio.run(run_pd(survivor.address, decode.address, f"after-{i}", p))[0] for i, p in enumerate(batch)]
    assert got == reference(long_llama, batch)


async def _running(address: str) -> bool:
    try:
        return (await load(address)).running > 0
    except grpc.aio.AioRpcError:
        return False


async def _handoff_started(address: str) -> bool:
    """The prefill node holds a request: queued, prefilling, or its pages parked for a handoff."""
    report = await load(address)
    return report.waiting + report.running + report.kv_pages_parked > 0


def test_injected_transfer_failures_fail_cleanly(long_llama: Path, decode: NodeProcess, tmp_path: Path) -> None:
    faulty = start_prefill(long_llama, tmp_path / "faulty.log", env=handoff_env(tmp_path / "faults.json", rate=0.1))
    batch = prompts(20, seed=3)
    expected = reference(long_llama, batch)

    async def one(i: int, prompt: list[int]) -> list[int] | BaseException:
        try:
            return (await asyncio.wait_for(run_pd(faulty.address, decode.address, f"f{i}", prompt), 90))[0]
        except pd_flow.HandoffFailed as exc:
            return exc

    async def main() -> list:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))

    try:
        results = asyncio.run(main())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 2, results  # exactly every tenth handoff
        for exc in failed:
            assert exc.code == grpc.StatusCode.ABORTED and "KV handoff failed" in str(exc)
        for got, want in zip(results, expected, strict=True):
            assert isinstance(got, BaseException) or got == want
        # A failed batch may still have blocks on the wire (Mooncake fails a batch at its first
        # failed block): P must not claim its writer stopped, so D quarantines those pages.
        assert asyncio.run(load(decode.address)).kv_pages_quarantined > 0
        wait_for(lambda: pages_back(decode.address), "the decode node frees every page", GRACE_S + 15)
        wait_for(lambda: pages_back(faulty.address), "the prefill node frees every page", 15)
        again = asyncio.run(run_pd(faulty.address, decode.address, "healthy", batch[0]))
        assert again[0] == expected[0]  # the 21st handoff: not one of the injected tenth
    finally:
        faulty.stop()


def test_frozen_decode_node_does_not_block_other_requests(long_llama: Path, decode: NodeProcess,
                                                          plain_prefill: NodeProcess, tmp_path: Path) -> None:
    prefill = plain_prefill
    frozen = NodeProcess("decode", ["--model", str(long_llama), *DECODE_ARGS], tmp_path / "frozen.log").wait_ready()
    prompt = prompts(1, seed=5)[0] * 4
    try:
        dest = asyncio.run(reserve(frozen.address, "stuck", prompt)).destination
        frozen.signal(signal.SIGSTOP)

        async def stuck() -> tuple[grpc.StatusCode, bool, float]:
            start = time.monotonic()
            async with grpc.aio.insecure_channel(prefill.address) as channel:
                try:
                    await pb_grpc.PrefillServiceStub(channel).Prefill(pb.PrefillRequest(
                        request_id="stuck", prompt_ids=prompt, sampling=greedy(), destination=dest,
                        timeout_seconds=20), timeout=40)
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), pd_flow.destination_failed(exc), time.monotonic() - start
            return grpc.StatusCode.OK, False, time.monotonic() - start

        async def healthy() -> tuple[list[int], float]:
            await wait_for_async(lambda: _handoff_started(prefill.address), "the stuck handoff starts first", 10)
            start = time.monotonic()
            tokens, _ = await run_pd(prefill.address, decode.address, "free", prompt)
            return tokens, time.monotonic() - start

        async def main():
            return await asyncio.gather(stuck(), healthy())

        (code, blames_destination, stuck_s), (tokens, free_s) = asyncio.run(main())
        assert code is grpc.StatusCode.ABORTED, code  # the transfer timed out (5 s) before the 20 s deadline
        assert blames_destination, "P blamed itself for its frozen destination (its breaker would open)"
        assert stuck_s < 20 + 5, "the stuck handoff outlived its deadline"
        assert tokens == reference(long_llama, [prompt])[0]
        assert free_s < stuck_s, "the healthy request waited for the frozen peer"
        frozen.stop()  # thaws and ends it: the stuck transfer fails, and the pages it read come back
        wait_for(lambda: pages_back(prefill.address), "the prefill node frees every page", 30)
        wait_for(lambda: pages_back(decode.address), "the healthy decode node is clean", 15)
    finally:
        frozen.stop()


def test_a_release_sent_while_the_decode_node_is_frozen_lands_when_it_thaws(decode: NodeProcess, monkeypatch
                                                                           ) -> None:
    """A handoff that fails while D is frozen (SIGSTOP) is released while D cannot answer; that
    release must land when D thaws, or the reservation holds its pages for the whole lease (the
    router asks for its 600 s deadline): the reliability campaign found 7 such reservations."""
    monkeypatch.setattr(pd_flow, "RELEASE_TIMEOUT_S", 0.5)

    async def scenario() -> bool:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            pair = pd_flow.Pair.connect(channel, channel)  # Release goes to D only
            reserved = await reserve(decode.address, "frozen-release", prompts(1, seed=31)[0], lease=600)
            decode.signal(signal.SIGSTOP)
            try:
                await pd_flow.release(pair, reserved.destination.reservation_id, writer_stopped=True)
            finally:
                decode.signal(signal.SIGCONT)
            deadline = time.monotonic() + 20
            while not await pages_back(decode.address) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # poll interval; the retry runs on this loop
            return await pages_back(decode.address)

    assert asyncio.run(scenario()), "the thawed decode node still holds the released reservation"
