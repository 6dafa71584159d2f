"""Prefill-decode disaggregation with real processes on loopback: a prefill node and a decode
node (real Mooncake transfer engines over TCP), driven through gRPC as the router drives them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster import NodeProcess
from tiny_models import make_tiny_model

from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.sampling_params import SamplingParams
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import pd_flow

pytestmark = pytest.mark.integration
PAGE, CHUNK, MAX_NEW = 16, 64, 12
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # tiny llama: layers x (K, V) x kv heads x head dim x float32
NODE_ARGS = ["--device", "cpu", "--dtype", "float32", "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK),
             "--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pd-llama"), max_position=2048)


@pytest.fixture(scope="module")
def pair_nodes(model: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    prefill = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS], logs / "prefill.log")
    decode = NodeProcess("decode", ["--model", str(model), *NODE_ARGS], logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([5, 17, 40, 3 * CHUNK + 7, 5 * CHUNK]) for _ in range(n)]
    return [[rng.randrange(2, 384) for _ in range(length)] for length in lengths]


def reference(model: Path, batch: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model, device="cpu", dtype="float32", page_size=PAGE, chunked_prefill_size=CHUNK,
                                 max_total_tokens=4096))
    return engine.generate(batch, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))


def greedy(max_tokens: int = MAX_NEW) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def run_pd(prefill: str, decode: str, rid: str, prompt: list[int], salt: str = ""
                 ) -> tuple[list[int], pb.PrefillResponse]:
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done = await pd_flow.prefill(pair, rid, prompt, greedy(), salt, timeout_s=60)
        tokens = [t async for chunk in pd_flow.generate(pair, done, greedy()) for t in chunk.token_ids]
        return tokens, done.response


async def load(address: str) -> pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).Load(pb.LoadRequest())


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
