"""The deadline chain of a prefill/decode pair: a KV write that lands after its prefill gave up
must never reach pages another request uses, and a prefill slower than the decode node's lease
ends (and its pages come back) instead of writing into freed pages or hanging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.injected_faults import handoff_env
from helpers.pd_nodes import NODE_ARGS, greedy, load, reference
from helpers.polling import wait_for
from helpers.processes import NodeProcess

from tierserve.cache.allocator import PageAllocator
from tierserve.cache.base import NoPrefixCache
from tierserve.core.sampling import SamplingParams
from tierserve.engine.request import Request
from tierserve.engine.reservations import Reservations, ReservationTerms
from tierserve.router import pd_flow

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DELAY_S = 3.0  # the slow prefill node holds each handoff's first batch this long
GRACE_S = 8.0  # > DELAY_S and > the 5 s transfer timeout
MAX_LEASE_S = 3.0  # the decode node's cap: the router's 60 s prefill deadline shrinks to fit it


@pytest.fixture(scope="module")
def nodes(long_llama: Path, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    logs = tmp_path_factory.mktemp("deadlines")
    model = ["--model", str(long_llama)]
    procs = {
        "decode": NodeProcess("decode", [*model, *NODE_ARGS, "--reservation-grace", str(GRACE_S), "--lease-seconds",
                                         str(MAX_LEASE_S), "--max-lease-seconds", str(MAX_LEASE_S)], logs / "d.log"),
        "slow": NodeProcess("prefill", [*model, *NODE_ARGS], logs / "s.log",
                            handoff_env(logs / "slow.json", delay_s=DELAY_S)),
        "healthy": NodeProcess("prefill", [*model, *NODE_ARGS], logs / "h.log"),
    }
    try:
        yield {name: proc.wait_ready() for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def prompt(seed: int, length: int = 200) -> list[int]:
    return [2 + (seed * 131 + i * 7) % 380 for i in range(length)]


async def prefill(p: NodeProcess, d: NodeProcess, rid: str, tokens: list[int], timeout_s: float
                  ) -> tuple[pd_flow.Pair, pd_flow.Prefilled, grpc.aio.Channel, grpc.aio.Channel]:
    pch, dch = grpc.aio.insecure_channel(p.address), grpc.aio.insecure_channel(d.address)
    pair = pd_flow.Pair.connect(pch, dch)
    return pair, await pd_flow.prefill(pair, rid, tokens, greedy(), timeout_s=timeout_s), pch, dch


async def late_write_then_generate(nodes: dict[str, NodeProcess]) -> list[int]:
    """Request A's handoff times out while its first batch is still on the way; request B, as
    long, is prefilled right after (by a healthy node) and generates only once A's batch landed."""
    with pytest.raises(pd_flow.HandoffFailed):
        await prefill(nodes["slow"], nodes["decode"], "late", prompt(1), timeout_s=1.0)
    pair, done, pch, dch = await prefill(nodes["healthy"], nodes["decode"], "victim", prompt(2), timeout_s=60)
    try:
        wait_until_landed = time.monotonic() + 30
        while (await load(nodes["slow"].address)).kv_pages_parked:  # A's pages stay parked until its batch ends
            assert time.monotonic() < wait_until_landed, "the late batch ends"
            await asyncio.sleep(0.05)  # poll interval
        return [t async for chunk in pd_flow.generate(pair, done, greedy()) for t in chunk.token_ids]
    finally:
        await pch.close()
        await dch.close()


def test_a_late_kv_write_never_changes_another_requests_output(long_llama: Path, nodes) -> None:
    got = asyncio.run(late_write_then_generate(nodes))
    assert got == reference(long_llama, [prompt(2)])[0]
    decode = nodes["decode"].address
    wait_for(lambda: _pages_back(decode), "the quarantined pages come back after the grace period", GRACE_S + 15)


def test_a_prefill_slower_than_the_lease_ends_within_it_and_corrupts_nothing(long_llama: Path, nodes) -> None:
    started = time.monotonic()
    with pytest.raises(pd_flow.HandoffFailed) as failed:
        asyncio.run(_prefill_and_close(nodes["slow"], nodes["decode"], "slow", prompt(3), timeout_s=60))
    assert time.monotonic() - started < MAX_LEASE_S + 2, "the prefill leg ends within the lease it was granted"
    assert failed.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
    decode = nodes["decode"].address
    wait_for(lambda: _pages_back(decode), "the slow request's pages come back", GRACE_S + 15)
    got = asyncio.run(late_write_then_generate(nodes))  # the decode node is still sound afterwards
    assert got == reference(long_llama, [prompt(2)])[0]


async def _prefill_and_close(p: NodeProcess, d: NodeProcess, rid: str, tokens: list[int], timeout_s: float) -> None:
    pair, done, pch, dch = await prefill(p, d, rid, tokens, timeout_s)
    await pd_flow.release(pair, done.reservation_id, writer_stopped=True)
    await pch.close()
    await dch.close()


async def _pages_back(address: str) -> bool:
    report = await load(address)
    return report.reservations == 0 and report.kv_pages_quarantined == 0


def test_quarantined_pages_are_not_handed_out_during_grace() -> None:
    """The clock is the caller's (rank 0's on a node of several ranks), so this needs no waiting."""
    allocator = PageAllocator(8)
    reservations = Reservations(allocator, NoPrefixCache(allocator), page_size=4)
    terms = ReservationTerms(lease_s=30.0, grace_s=0.3, headroom_tokens=4)
    first = Request("a", list(range(12)), SamplingParams(max_tokens=4))
    reservations.reserve(first, 16, terms, now=100.0)
    pages = set(first.pages)
    reservations.cancel("a", writer_stopped=False, now=100.0)  # the writer may still be writing into them
    second = Request("b", list(range(12)), SamplingParams(max_tokens=4))
    reservations.reserve(second, 16, terms, now=100.0)
    assert pages.isdisjoint(second.pages) and reservations.quarantined_pages == 4
    reservations.cancel("b", writer_stopped=True, now=100.0)
    assert allocator.alloc(5) is None, "quarantined pages stay out of the free list"
    reservations.tick(100.29)
    assert reservations.quarantined_pages == 4, "still within the grace"
    reservations.tick(100.31)
    assert sorted(allocator.alloc(8)) == list(range(8))


def test_a_lease_expires_at_the_given_time_only() -> None:
    allocator = PageAllocator(8)
    reservations = Reservations(allocator, NoPrefixCache(allocator), page_size=4)
    reservations.reserve(Request("a", list(range(8)), SamplingParams(max_tokens=4)), 12, ReservationTerms(lease_s=5.0),
                         now=10.0)
    assert reservations.tick(14.9) == [] and reservations.tick(15.0) == ["a"]
    assert reservations.expired_leases == 1 and reservations.quarantined_pages == 3
