"""Prefill and decode nodes of two ranks (TP 2, issue 14; or PP 2 stages, issue 15 items 8 and 9)
with HiCache (L1, L2) and L3 on a real ``mooncake_master``: real node processes driven through gRPC
as the router drives them. Answers equal the single engine's (no cache); a repeated prompt hits L1,
then L2, on the prefill node of two ranks; once its L1 and L2 are flushed the prompt comes at least
90% from L3 (every rank reading its head or layer range); a decode node of two ranks offloads what it
generated to L3 (by head range or by stage), one of one rank offloads it whole, and the prefill node
reads it back.

Each layout ("tp", "pp") starts its master and nodes once for the module: a prefill node "p2" of two
ranks, decode nodes "d2" of two and "d1" of one."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, PAGE, reference, run_pd
from helpers.polling import wait_for
from helpers.processes import MasterProcess, NodeProcess, master_running, store_client
from helpers.tiny_models import make_tiny_model

from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, LayerRange, object_key
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.model.identity import model_identity
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KV_HEADS = 4  # TP 2 ranks hold 2 each
LAYERS = {"tp": 2, "pp": 4}  # PP 2 stages hold 2 layers each
OFFLOAD_DEADLINE_S = 60.0  # backups run in the background after the answer


@pytest.fixture(scope="module", params=["tp", "pp"])
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(layout: str, tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp(f"{layout}_pd_l3"), heads=8, kv_heads=KV_HEADS,
                           layers=LAYERS[layout], max_position=2048)


@pytest.fixture(scope="module")
def layout_master(layout: str, tmp_path_factory) -> Iterator[MasterProcess]:
    """One ``mooncake_master`` per layout, as each layout's nodes had one per module."""
    with master_running(tmp_path_factory.mktemp(f"{layout}-master") / "master.log") as master:
        yield master


@pytest.fixture(scope="module")
def store(layout_master: MasterProcess) -> Iterator[MooncakeStorage]:
    """A client of the layout's L3 that lends it no memory (it only asks what is there)."""
    with store_client(layout_master) as client:
        yield client


def hicache_args(master: MasterProcess) -> list[str]:
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3),
            "--hicache-storage-prefetch-policy", "wait_complete"]


def sizes(layout: str, ranks: int) -> list[str]:
    return ["--tp-size", str(ranks)] if layout == "tp" else ["--pp-size", str(ranks)]


@pytest.fixture(scope="module")
def nodes(model: Path, layout: str, layout_master: MasterProcess, tmp_path_factory
          ) -> Iterator[dict[str, NodeProcess]]:
    """A prefill node "p2" of two ranks and decode nodes of two ("d2") and one ("d1"), all on one L3."""
    logs = tmp_path_factory.mktemp(f"{layout}-pd-l3-logs")
    plan = {"p2": ("prefill", NODE_ARGS, 2), "d2": ("decode", DECODE_ARGS, 2), "d1": ("decode", DECODE_ARGS, 1)}
    l3 = hicache_args(layout_master)
    started = {name: NodeProcess(role, ["--model", str(model), *args, *l3, *sizes(layout, n)], logs / f"{name}.log")
               for name, (role, args, n) in plan.items()}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


def l3_names(model: Path, layout: str, tokens: list[int], ranks: int) -> list[bytes]:
    """The L3 objects a node of ``ranks`` ranks writes for the full pages of ``tokens``: one per page
    and rank, named by the rank's KV head range (TP) or its stage's layer range (PP, at TP 1)."""
    layers = LAYERS[layout]
    seed = Namespace(model_identity(model), "float32", PAGE, layers, KV_HEADS, 16,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    if layout == "tp":
        count = KV_HEADS // ranks
        return [object_key(k, HeadRange(h, count, KV_HEADS)) for k in keys for h in range(0, KV_HEADS, count)]
    per = layers // ranks
    return [object_key(k, HeadRange(0, KV_HEADS, KV_HEADS), LayerRange(s * per, per, layers))
            for k in keys for s in range(ranks)]


async def flush(address: str, device: bool = True, host: bool = True) -> pb.FlushCacheResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.NodeServiceStub(channel).FlushCache(pb.FlushCacheRequest(device=device, host=host))


def fresh_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 384) for _ in range(length)]


def pd(nodes: dict[str, NodeProcess], p: str, d: str, rid: str, prompt: list[int]
       ) -> tuple[list[int], pb.CacheReport]:
    answer, response = asyncio.run(run_pd(nodes[p].address, nodes[d].address, rid, prompt))
    return answer, response.cache


def test_prefill_of_two_ranks_hits_l1_then_l2_then_l3(model: Path, nodes) -> None:
    prompt = fresh_prompt(1, 150)  # 9 full pages
    expected = reference(model, [prompt])[0]
    answer, cache = pd(nodes, "p2", "d2", "tiers-0", prompt)
    assert answer == expected and cache.cached_tokens == 0, cache
    answer, cache = pd(nodes, "p2", "d2", "tiers-1", prompt)
    assert answer == expected and cache.device >= 0.9 * len(prompt), cache
    assert asyncio.run(flush(nodes["p2"].address, host=False)).device_pages > 0  # L2 keeps its copies
    answer, cache = pd(nodes, "p2", "d2", "tiers-2", prompt)
    assert answer == expected and cache.host >= 0.9 * len(prompt) and cache.storage == 0, cache
    flushed = asyncio.run(flush(nodes["p2"].address))
    assert flushed.device_pages > 0 and flushed.host_pages > 0  # only L3 can serve the prompt now
    answer, cache = pd(nodes, "p2", "d2", "tiers-3", prompt)
    assert answer == expected and cache.storage >= 0.9 * len(prompt), cache


@pytest.mark.parametrize(("decode", "turn_seed"), [("d2", 2), ("d1", 3)])
def test_decode_offloads_and_prefill_of_two_ranks_reads_it(model: Path, layout: str, nodes, store,
                                                           decode: str, turn_seed: int) -> None:
    """Each turn's prompt is the last turn's prompt and answer plus new words; the answer's KV
    exists only on the decode node, so L3 has it only if that node offloaded it."""
    ranks = int(decode[1])
    prompt = fresh_prompt(turn_seed, 120)
    previous = -1
    for turn in range(3):
        if turn:
            asyncio.run(flush(nodes["p2"].address))  # only L3 can serve the history
        answer, cache = pd(nodes, "p2", decode, f"{decode}-turn-{turn}", prompt)
        assert answer == reference(model, [prompt])[0], turn
        if turn:
            assert cache.storage == cache.cached_tokens > previous, (turn, cache)
            assert cache.cached_tokens >= len(prompt) - 40 - PAGE, (turn, cache)  # reaches into the answer
        previous = cache.cached_tokens
        sequence = prompt + answer
        names = l3_names(model, layout, sequence[:-1], ranks)  # the last token has no KV yet
        wait_for(lambda names=names: store.batch_exists(names) == len(names),
                 f"a {layout.upper()} {ranks} decode node offloads to L3", OFFLOAD_DEADLINE_S)
        prompt = sequence + fresh_prompt(turn_seed * 10 + turn, 40)
