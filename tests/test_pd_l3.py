"""The decode node offloads finished sequences to L3 and the prefill node reads them back: a
multi-turn conversation through real processes (mooncake_master, prefill and decode nodes)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import NODE_ARGS, PAGE, greedy, load, reference, run_pd
from helpers.polling import wait_for
from helpers.processes import MasterProcess, NodeProcess

from tierserve.cache.hashing import page_keys
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.router import pd_flow

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(long_llama: Path, tmp_path_factory) -> Iterator[tuple[NodeProcess, NodeProcess, MasterProcess]]:
    logs = tmp_path_factory.mktemp("pd-l3")
    master = MasterProcess(logs / "master.log").start()
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE}
    hicache = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
               "--hicache-storage-backend-extra-config", json.dumps(l3),
               "--hicache-storage-prefetch-policy", "wait_complete"]
    args = ["--model", str(long_llama), *NODE_ARGS, *hicache]
    prefill = NodeProcess("prefill", args, logs / "prefill.log")
    decode = NodeProcess("decode", args, logs / "decode.log")
    try:
        yield prefill.wait_ready(), decode.wait_ready(), master
    finally:
        prefill.stop()
        decode.stop()
        master.kill()


def in_l3(store: MooncakeStorage, seed: bytes, tokens: list[int]) -> int:
    """How many leading full pages of ``tokens`` L3 holds."""
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    return store.batch_exists(keys) if keys else 0


async def flush(address: str) -> pb.FlushCacheResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).FlushCache(pb.FlushCacheRequest(device=True, host=True))


def test_each_turn_reads_what_the_decode_node_offloaded(long_llama: Path, cluster) -> None:
    prefill, decode, master = cluster
    seed = Engine(EngineConfig(long_llama, device="cpu", dtype="float32", page_size=PAGE,
                               max_total_tokens=256)).namespace.seed()
    store = MooncakeStorage(master.address, global_segment_size=16 << 20, local_buffer_size=16 << 20)
    rng = random.Random(1)
    prompt = [rng.randrange(2, 384) for _ in range(150)]
    previous = -1
    for turn in range(4):
        if turn:
            flushed = asyncio.run(flush(prefill.address))  # only L3 can serve the history now
            assert flushed.device_pages > 0 and flushed.host_pages > 0
        answer, response = asyncio.run(run_pd(prefill.address, decode.address, f"turn-{turn}", prompt))
        assert answer == reference(long_llama, [prompt])[0]
        cache = response.cache
        if turn:
            assert cache.cached_tokens > previous, (turn, cache)
            assert cache.storage == cache.cached_tokens, cache
        previous = cache.cached_tokens
        sequence = prompt + answer
        # the answer's last token has no KV yet; every full page before it goes to L3 in the background
        wait_for(lambda s=sequence: in_l3(store, seed, s[:-1]) == (len(s) - 1) // PAGE,
                 "the decode node offloads prompt and answer to L3", 30)
        prompt = sequence + [rng.randrange(2, 384) for _ in range(40)]
    store.close()


def test_abort_during_generation_and_offload_leaks_nothing(long_llama: Path, cluster) -> None:
    prefill, decode, _ = cluster
    prompt = [2 + (i * 11) % 380 for i in range(300)]

    async def abort_early() -> int:
        async with grpc.aio.insecure_channel(prefill.address) as p, grpc.aio.insecure_channel(decode.address) as d:
            pair = pd_flow.Pair.connect(p, d)
            done = await pd_flow.prefill(pair, "aborted", prompt, greedy(200))
            received = 0
            async for chunk in pd_flow.generate(pair, done, greedy(200)):
                received += len(chunk.token_ids)
                if received >= 3:
                    break  # the client goes away: the stream is cancelled, D aborts and offloads
            return received

    assert asyncio.run(abort_early()) >= 3

    async def clean() -> bool:
        report = await load(decode.address)
        return report.running == 0 and report.kv_pages_used == 0 and report.reservations == 0

    wait_for(clean, "the decode node holds no request pages", 15)

    async def prefill_clean() -> bool:  # its request ends at its next step after the handoff's last batch
        return (await load(prefill.address)).kv_pages_used == 0

    wait_for(prefill_clean, "the prefill node holds no request pages", 15)
