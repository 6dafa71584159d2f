"""Prefill and decode nodes of different TP sizes hand KV to each other (issue 14, item 4): real
node processes (each rank its own transfer engine over TCP), driven through gRPC as the router
drives them. Outputs equal the single engine; the handoff moves exactly the KV bytes of the
uncached prompt; a destination that cannot be written is refused with a clear error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import (
    DECODE_ARGS,
    NODE_ARGS,
    PAGE,
    greedy,
    idle,
    load,
    prompts,
    reference,
    reserve,
    run_all,
    run_pd,
)
from helpers.polling import wait_for
from helpers.processes import NodeProcess
from helpers.tiny_models import make_tiny_model

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
TOKEN_BYTES = 2 * 2 * 4 * 16 * 4  # layers x (K, V) x the model's 4 KV heads x head dim x float32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp_pd_llama"), heads=8, kv_heads=4, max_position=2048)


@pytest.fixture(scope="module")
def nodes(model: Path, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """Prefill and decode nodes at TP 1 and 2: "p1", "p2", "d1", "d2"."""
    logs = tmp_path_factory.mktemp("tp-pd-logs")
    started = {f"{role[0]}{tp}": NodeProcess(role, ["--model", str(model), *args, "--tp-size", str(tp)],
                                             logs / f"{role}-{tp}.log")
               for role, args in (("prefill", NODE_ARGS), ("decode", DECODE_ARGS)) for tp in (1, 2)}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


@pytest.mark.parametrize(("p", "d"), [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_outputs_equal_the_single_engine_across_tp_sizes(model: Path, nodes, p: str, d: str) -> None:
    batch = prompts(4, seed=int(p[1]) * 10 + int(d[1]))  # fresh prompts: no decode node caches them yet
    results = asyncio.run(run_all(nodes[p].address, nodes[d].address, batch, f"{p}{d}-"))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    for (_, response), prompt in zip(results, batch, strict=True):
        assert response.transferred_bytes == len(prompt) * TOKEN_BYTES  # every head of every token, once
    wait_for(lambda: idle(nodes[p].address, nodes[d].address), "every page back on both nodes", 10)


def test_a_decode_cache_hit_at_tp_2_moves_only_the_uncached_tokens(model: Path, nodes) -> None:
    prompt = prompts(1, seed=11)[0] + list(range(2, 2 + 3 * PAGE))
    first, r1 = asyncio.run(run_pd(nodes["p2"].address, nodes["d2"].address, "hit-a", prompt))
    again, r2 = asyncio.run(run_pd(nodes["p1"].address, nodes["d2"].address, "hit-b", prompt))
    assert first == again == reference(model, [prompt])[0]
    held = (len(prompt) - 1) // PAGE * PAGE  # whole pages below the last token, kept by D's radix cache
    assert r1.transferred_bytes == len(prompt) * TOKEN_BYTES
    assert r2.transferred_bytes == (len(prompt) - held) * TOKEN_BYTES


def test_the_destination_names_every_decode_rank(nodes) -> None:
    dest = asyncio.run(reserve(nodes["d2"].address, "ranks", list(range(2, 40)))).destination
    assert [(r.kv_head_start, r.kv_heads) for r in dest.ranks] == [(0, 2), (2, 2)]
    assert len({r.transfer_endpoint for r in dest.ranks}) == 2  # a transfer engine per rank
    assert dest.transfer_endpoint == dest.ranks[0].transfer_endpoint
    asyncio.run(_release(nodes["d2"].address, "ranks"))


def test_a_destination_missing_heads_is_refused_with_a_clear_error(nodes) -> None:
    prompt = list(range(2, 40))
    dest = asyncio.run(reserve(nodes["d2"].address, "half", prompt)).destination
    del dest.ranks[1]  # as if the decode node had only rank 0: heads 2 and 3 would go nowhere
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_prefill(nodes["p2"].address, "half", prompt, dest))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hold no copy of KV heads [2, 3]" in refused.value.details()
    asyncio.run(_release(nodes["d2"].address, "half"))


def test_info_reports_the_tp_size(nodes) -> None:
    assert [asyncio.run(_info(nodes[n].address)).tp_size for n in ("p1", "p2", "d1", "d2")] == [1, 2, 1, 2]


async def _prefill(address: str, rid: str, prompt: list[int], dest: pb.KVDestination) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.PrefillServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=greedy(), destination=dest))


async def _release(address: str, rid: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.DecodeServiceStub(channel).Release(pb.ReleaseRequest(reservation_id=rid, writer_stopped=True))


async def _info(address: str) -> pb.NodeInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).Info(pb.InfoRequest())


def test_long_prompts_between_tp_sizes_fit_the_transfer_engines_limits(model: Path, nodes) -> None:
    """Without staging (a Reserve that does not name the prefill node's TP size) head sub-ranges
    move one block per token: 1,200-token prompts make 2,400 blocks per layer and rank, above what
    one Mooncake engine takes in flight, three at once on the same engines."""
    batch = [[2 + (i * 31 + j * 7) % 380 for j in range(1200)] for i in range(3)]
    results = asyncio.run(run_all(nodes["p2"].address, nodes["d1"].address, batch, "long-", source_tp=0))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * TOKEN_BYTES for p in batch]


def test_a_kv_head_replicated_on_both_sides_is_sent_once_per_decode_rank(tmp_path: Path) -> None:
    """One KV head, TP 2 on both sides: both prefill ranks hold it, only the first sends it; both
    decode ranks hold it, each gets its own copy (so twice the model's bytes arrive)."""
    model = make_tiny_model("qwen3", tmp_path / "qwen3", heads=4, kv_heads=1, max_position=2048)
    args = ["--model", str(model), "--tp-size", "2"]
    prefill = NodeProcess("prefill", [*NODE_ARGS, *args], tmp_path / "p.log")
    decode = NodeProcess("decode", [*DECODE_ARGS, *args], tmp_path / "d.log")
    try:
        prefill.wait_ready(), decode.wait_ready()
        batch = prompts(3, seed=9)
        results = asyncio.run(run_all(prefill.address, decode.address, batch, "replica-"))
    finally:
        prefill.stop()
        decode.stop()
    assert [tokens for tokens, _ in results] == reference(model, batch)
    one_head = 2 * 2 * 1 * 16 * 4  # layers x (K, V) x 1 KV head x head dim x float32
    assert [r.transferred_bytes for _, r in results] == [2 * len(p) * one_head for p in batch]


def test_a_decode_rank_stages_what_prefill_ranks_of_fewer_heads_write(nodes) -> None:
    """D1 reserved for a TP=2 writer offers a staged part per prefill rank's heads (so each writes
    whole slots of its own, coalesced); the staging goes back when the reservation ends."""
    dest = asyncio.run(_reserve(nodes["d1"].address, "staged", list(range(2, 40)), source_tp=2)).destination
    assert [(s.kv_head_start, s.kv_heads, s.tokens) for s in dest.ranks[0].staged] == [(0, 2, 38), (2, 2, 38)]
    assert asyncio.run(load(nodes["d1"].address)).staging_bytes_used >= 2 * 2 * 38 * 4 * 16 * 4
    asyncio.run(_release(nodes["d1"].address, "staged"))
    assert asyncio.run(load(nodes["d1"].address)).staging_bytes_used == 0
    same = asyncio.run(_reserve(nodes["d2"].address, "same", list(range(2, 40)), source_tp=2)).destination
    assert [list(r.staged) for r in same.ranks] == [[], []]  # the same split: in place
    asyncio.run(_release(nodes["d2"].address, "same"))


def test_a_prefill_node_of_another_tp_size_than_the_reserve_named_is_refused(nodes) -> None:
    """D staged for TP=2 writers; a TP=1 prefill node would leave the parts unwritten and D would
    scatter them over the pages: refused before anything is computed or sent."""
    prompt = list(range(2, 40))
    dest = asyncio.run(_reserve(nodes["d1"].address, "wrong-tp", prompt, source_tp=2)).destination
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_prefill(nodes["p1"].address, "wrong-tp", prompt, dest))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another prefill TP size than this node's 1" in refused.value.details()
    asyncio.run(_release(nodes["d1"].address, "wrong-tp"))


async def _reserve(address: str, rid: str, prompt: list[int], source_tp: int) -> pb.ReserveResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DecodeServiceStub(channel).Reserve(
            pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=4, source_tp_size=source_tp))


@pytest.mark.slow
def test_every_decode_rank_scatters_its_staging_at_the_same_offset(model: Path, nodes, tmp_path: Path) -> None:
    """Prefill TP=4 (one KV head per rank) into decode TP=2: both decode ranks stage two parts,
    rank 0 names rank 1's from its own offset, and the answers equal the single engine's."""
    prefill = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS, "--tp-size", "4"], tmp_path / "p4.log")
    try:
        prefill.wait_ready()
        batch = prompts(3, seed=41)
        results = asyncio.run(run_all(prefill.address, nodes["d2"].address, batch, "p4d2-"))
        wait_for(lambda: idle(prefill.address, nodes["d2"].address), "every page and staging byte back", 10)
    finally:
        prefill.stop()
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * TOKEN_BYTES for p in batch]
    dest = asyncio.run(_reserve(nodes["d2"].address, "p4-parts", list(range(2, 40)), source_tp=4)).destination
    asyncio.run(_release(nodes["d2"].address, "p4-parts"))
    assert [[s.kv_head_start for s in r.staged] for r in dest.ranks] == [[0, 1], [2, 3]]
