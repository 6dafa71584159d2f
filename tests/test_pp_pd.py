"""Prefill and decode nodes with pipeline stages hand KV to each other (issue 15, item 9): real node
processes (each rank its own transfer engine over TCP, each stage's arena holding its layers only),
driven through gRPC as the router drives them. Each prefill stage sends its layers to the decode
ranks holding them; outputs equal the single engine; the handoff moves exactly the KV bytes of the
uncached prompt; a destination that leaves layers with no rank is refused with a clear error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, PAGE, greedy, idle, prompts, reference, reserve, run_all, run_pd
from helpers.polling import wait_for
from helpers.processes import NodeProcess
from helpers.tiny_models import make_tiny_model

from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration
LAYERS = 4
TOKEN_BYTES = LAYERS * 2 * 4 * 16 * 4  # layers x (K, V) x the model's 4 KV heads x head dim x float32
SIZES = {"p1": ("prefill", 1, 1), "d1": ("decode", 1, 1), "pp2": ("prefill", 1, 2), "dp2": ("decode", 1, 2)}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pp_pd_llama"), heads=8, kv_heads=4, layers=LAYERS,
                           max_position=2048)


def _node(model: Path, name: str, role: str, tp: int, pp: int, logs: Path) -> NodeProcess:
    args = NODE_ARGS if role == "prefill" else DECODE_ARGS
    return NodeProcess(role, ["--model", str(model), *args, "--tp-size", str(tp), "--pp-size", str(pp)],
                       logs / f"{name}.log")


@pytest.fixture(scope="module")
def nodes(model: Path, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """Prefill and decode nodes at PP 1 and 2 (TP 1): "p1", "d1", "pp2", "dp2"."""
    logs = tmp_path_factory.mktemp("pp-pd-logs")
    started = {name: _node(model, name, *sizes, logs) for name, sizes in SIZES.items()}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


def _check_pairing(model: Path, prefill: str, decode: str, seed: int, tag: str) -> None:
    """Fresh prompts through the pair: the single engine's answers, every head of every layer of
    every token sent once, and every page (and staging byte) back on both nodes."""
    batch = prompts(4, seed=seed)
    results = asyncio.run(run_all(prefill, decode, batch, tag))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * TOKEN_BYTES for p in batch]
    wait_for(lambda: idle(prefill, decode), "every page back on both nodes", 10)


@pytest.mark.parametrize(("p", "d"), [("pp2", "d1"), ("p1", "dp2"), ("pp2", "dp2")])
def test_outputs_equal_the_single_engine_across_pp_sizes(model: Path, nodes, p: str, d: str) -> None:
    _check_pairing(model, nodes[p].address, nodes[d].address, 100 + SIZES[p][2] * 10 + SIZES[d][2], f"{p}{d}-")


def test_a_decode_cache_hit_with_stages_moves_only_the_uncached_tokens(model: Path, nodes) -> None:
    prompt = prompts(1, seed=12)[0] + list(range(2, 2 + 3 * PAGE))
    first, r1 = asyncio.run(run_pd(nodes["pp2"].address, nodes["dp2"].address, "pp-hit-a", prompt))
    again, r2 = asyncio.run(run_pd(nodes["p1"].address, nodes["dp2"].address, "pp-hit-b", prompt))
    assert first == again == reference(model, [prompt])[0]
    held = (len(prompt) - 1) // PAGE * PAGE  # whole pages below the last token, kept by D's radix cache
    assert r1.transferred_bytes == len(prompt) * TOKEN_BYTES
    assert r2.transferred_bytes == (len(prompt) - held) * TOKEN_BYTES


def test_the_destination_names_each_decode_stage_s_layers(nodes) -> None:
    dest = asyncio.run(reserve(nodes["dp2"].address, "pp-ranks", list(range(2, 40)))).destination
    assert [(r.layer_start, r.num_layers, r.kv_head_start, r.kv_heads) for r in dest.ranks] == [(0, 2, 0, 4),
                                                                                                 (2, 2, 0, 4)]
    asyncio.run(_release(nodes["dp2"].address, "pp-ranks"))
    (whole,) = asyncio.run(reserve(nodes["d1"].address, "pp-one", list(range(2, 40)))).destination.ranks
    assert (whole.layer_start, whole.num_layers) == (0, LAYERS)
    asyncio.run(_release(nodes["d1"].address, "pp-one"))
    staged = asyncio.run(_reserve(nodes["dp2"].address, "pp-staged", list(range(2, 40)), source_tp=2)).destination
    asyncio.run(_release(nodes["dp2"].address, "pp-staged"))
    assert [[(s.kv_head_start, s.kv_heads, s.tokens) for s in r.staged] for r in staged.ranks] == [
        [(0, 2, 38), (2, 2, 38)]] * 2  # each stage's rank stages for TP 2 writers of its layers


def test_a_destination_missing_layers_is_refused_with_a_clear_error(nodes) -> None:
    prompt = list(range(2, 40))
    dest = asyncio.run(reserve(nodes["dp2"].address, "no-stage-1", prompt)).destination
    del dest.ranks[1]  # as if the decode node had only its first stage: layers 2 and 3 would go nowhere
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_prefill(nodes["pp2"].address, "no-stage-1", prompt, dest))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds layers [2, 3] of 4 of KV head 0" in refused.value.details()
    asyncio.run(_release(nodes["dp2"].address, "no-stage-1"))


def test_info_reports_the_pp_size(nodes) -> None:
    infos = [asyncio.run(_info(nodes[n].address)) for n in SIZES]
    assert [(i.tp_size, i.pp_size) for i in infos] == [(1, 1), (1, 1), (1, 2), (1, 2)]


@pytest.mark.slow
def test_stages_hand_over_between_tp_sizes_through_staging(model: Path, nodes, tmp_path: Path) -> None:
    """TP 2 x PP 2 on one side, TP 1 x PP 2 on the other: each stage's ranks of fewer heads write
    into the decode rank's staging (P > D), or each stage's rank of more heads gathers (P < D)."""
    prefill = _node(model, "pt2p2", "prefill", 2, 2, tmp_path)
    decode = _node(model, "dt2p2", "decode", 2, 2, tmp_path)
    try:
        prefill.wait_ready(), decode.wait_ready()
        _check_pairing(model, prefill.address, nodes["dp2"].address, 201, "t2p2-dp2-")
        _check_pairing(model, nodes["pp2"].address, decode.address, 202, "pp2-dt2p2-")
        _check_pairing(model, prefill.address, nodes["d1"].address, 203, "t2p2-d1-")
    finally:
        prefill.stop()
        decode.stop()


async def _prefill(address: str, rid: str, prompt: list[int], dest: pb.KVDestination) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.PrefillServiceStub(channel).Prefill(
            pb.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=greedy(), destination=dest))


async def _reserve(address: str, rid: str, prompt: list[int], source_tp: int) -> pb.ReserveResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.DecodeServiceStub(channel).Reserve(
            pb.ReserveRequest(request_id=rid, prompt_ids=prompt, max_new_tokens=4, source_tp_size=source_tp))


async def _release(address: str, rid: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await pb_grpc.DecodeServiceStub(channel).Release(pb.ReleaseRequest(reservation_id=rid, writer_stopped=True))


async def _info(address: str) -> pb.NodeInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).Info(pb.InfoRequest())
