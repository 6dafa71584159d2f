"""Prefill-decode disaggregation with real processes on loopback: a prefill node and a decode
node (real Mooncake transfer engines over TCP), driven through gRPC as the router drives them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import (
    DECODE_ARGS,
    GRACE_S,
    NODE_ARGS,
    PAGE,
    TOKEN_BYTES,
    greedy,
    load,
    prompts,
    reference,
    release,
    reserve,
    run_pd,
)
from helpers.polling import wait_for
from helpers.processes import NodeProcess

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
@pytest.fixture(scope="module")
def model(long_llama: Path) -> Path:
    return long_llama


@pytest.fixture(scope="module")
def pair_nodes(model: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    prefill = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS], logs / "prefill.log")
    decode = NodeProcess("decode", ["--model", str(model), *DECODE_ARGS], logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def test_outputs_equal_the_single_engine_for_concurrent_requests(model: Path, pair_nodes) -> None:
    prefill, decode = pair_nodes
    batch = prompts(8)
    expected = reference(model, batch)

    async def main() -> list[tuple[list[int], pb.PrefillResponse]]:
        return await asyncio.gather(*(run_pd(prefill.address, decode.address, f"c{i}", p) for i, p in enumerate(batch)))

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    for (_, response), prompt in zip(results, batch, strict=True):
        assert response.transferred_bytes == len(prompt) * TOKEN_BYTES  # every token's K and V, once
    assert asyncio.run(load(decode.address)).kv_pages_used == 0


def test_decode_node_cache_hit_means_fewer_bytes_and_same_output(model: Path, pair_nodes) -> None:
    prefill, decode = pair_nodes
    prompt = prompts(1, seed=7)[0] + list(range(2, 2 + 3 * PAGE))
    expected = reference(model, [prompt])[0]
    first, r1 = asyncio.run(run_pd(prefill.address, decode.address, "warm", prompt))
    again, r2 = asyncio.run(run_pd(prefill.address, decode.address, "again", prompt))
    assert first == again == expected
    held = (len(prompt) - 1) // PAGE * PAGE  # whole pages below the last token, kept by D's radix cache
    assert r1.transferred_bytes == len(prompt) * TOKEN_BYTES
    assert r2.transferred_bytes == (len(prompt) - held) * TOKEN_BYTES


def test_identity_mismatch_is_refused_with_a_clear_error(pair_nodes) -> None:
    prefill, decode = pair_nodes
    prompt = list(range(2, 40))
    reserved = asyncio.run(reserve(decode.address, "mismatch", prompt)).destination
    reserved.identity.page_size = PAGE * 2
    reserved.identity.dtype = "bfloat16"

    async def call() -> None:
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            await pb_grpc.PrefillServiceStub(channel).Prefill(pb.PrefillRequest(
                request_id="mismatch", prompt_ids=prompt, sampling=greedy(), destination=reserved))

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV identity mismatch" in err.value.details() and "page_size" in err.value.details()
    assert "dtype" in err.value.details()

    assert asyncio.run(release(decode.address, "mismatch", writer_stopped=True))
    assert asyncio.run(load(decode.address)).kv_pages_used == 0


def test_unknown_reservation_and_capacity_errors(pair_nodes) -> None:
    _, decode = pair_nodes

    async def generate_unknown() -> None:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            call = pb_grpc.DecodeServiceStub(channel).Generate(
                pb.GenerateRequest(reservation_id="nope", first_token=5, sampling=greedy()))
            async for _ in call:
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate_unknown())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(reserve(decode.address, "too-long", [2 + i % 380 for i in range(2100)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length" in err.value.details()

    big = [2 + i % 380 for i in range(1500)]  # three of these exceed the 4096-token pool
    asyncio.run(reserve(decode.address, "big-0", big))
    asyncio.run(reserve(decode.address, "big-1", big))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(reserve(decode.address, "big-2", big))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for rid in ("big-0", "big-1"):
        asyncio.run(release(decode.address, rid, writer_stopped=True))
    assert asyncio.run(load(decode.address)).kv_pages_used == 0


def test_expired_lease_is_reclaimed_after_the_grace_period(pair_nodes) -> None:
    _, decode = pair_nodes
    asyncio.run(reserve(decode.address, "forgotten", list(range(2, 100)), lease=0.3))
    assert asyncio.run(load(decode.address)).kv_pages_used > 0

    async def reclaimed() -> bool:
        report = await load(decode.address)
        return report.reservations == 0 and report.kv_pages_used == 0

    wait_for(reclaimed, "the expired reservation's pages come back", 0.3 + GRACE_S + 10)
    assert not asyncio.run(release(decode.address, "forgotten", writer_stopped=True))  # already gone
