"""Prefill and decode nodes at TP above 1 with HiCache (L1, L2) and L3 on a real ``mooncake_master``
(issue 14): real node processes driven through gRPC as the router drives them. Answers equal the
single engine's (no cache); a repeated prompt hits L1, then L2, on the prefill node; once its L1 and
L2 are flushed the prompt comes at least 90% from L3; a decode node at TP 2 offloads what it
generated to L3 (both ranks' head ranges), and a prefill node reads it back, at TP 2 and across TP
sizes (a TP 1 decode node's objects read by a TP 2 prefill node)."""

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
from helpers.processes import MasterProcess, NodeProcess
from helpers.tiny_models import make_tiny_model

from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, object_key
from tierserve.cache.storage.mooncake import MooncakeStorage
from tierserve.model.identity import model_identity
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KV_HEADS = 4  # TP 2 ranks hold 2 each
OFFLOAD_DEADLINE_S = 60.0  # backups run in the background after the answer


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp_pd_l3"), heads=8, kv_heads=KV_HEADS,
                           max_position=2048)


def hicache_args(master: MasterProcess) -> list[str]:
    l3 = {"master_server_address": master.address, "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
          "prefetch_threshold": 2 * PAGE}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3),
            "--hicache-storage-prefetch-policy", "wait_complete"]


@pytest.fixture(scope="module")
def nodes(model: Path, module_master: MasterProcess, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """A TP 2 prefill node "p2" and decode nodes at TP 2 ("d2") and TP 1 ("d1"), all on one L3."""
    logs = tmp_path_factory.mktemp("tp-pd-l3-logs")
    plan = {"p2": ("prefill", NODE_ARGS, 2), "d2": ("decode", DECODE_ARGS, 2), "d1": ("decode", DECODE_ARGS, 1)}
    l3 = hicache_args(module_master)
    started = {name: NodeProcess(role, ["--model", str(model), *args, *l3, "--tp-size", str(tp)], logs / f"{name}.log")
               for name, (role, args, tp) in plan.items()}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


def l3_names(model: Path, tokens: list[int], tp_size: int) -> list[bytes]:
    """The L3 objects a node of ``tp_size`` writes for the full pages of ``tokens``: one per page
    and rank, named by the rank's KV head range."""
    seed = Namespace(model_identity(model), "float32", PAGE, 2, KV_HEADS, 16,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    count = KV_HEADS // tp_size
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    return [object_key(k, HeadRange(h, count, KV_HEADS)) for k in keys for h in range(0, KV_HEADS, count)]


def wait_offloaded(store: MooncakeStorage, model: Path, sequence: list[int], tp_size: int) -> None:
    """Polls L3 until it holds every object a ``tp_size`` node writes for ``sequence``'s KV (the
    last token has none yet)."""
    names = l3_names(model, sequence[:-1], tp_size)
    wait_for(lambda: store.batch_exists(names) == len(names), f"a TP {tp_size} node offloads to L3",
             OFFLOAD_DEADLINE_S)


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


def test_prefill_at_tp2_hits_l1_then_l2_then_l3(model: Path, nodes) -> None:
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
def test_decode_offloads_at_tp_and_prefill_at_tp2_reads_it(model: Path, nodes, l3_store, decode: str,
                                                           turn_seed: int) -> None:
    """Each turn's prompt is the last turn's prompt and answer plus new words; the answer's KV
    exists only on the decode node, so L3 has it only if that node offloaded it."""
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
        wait_offloaded(l3_store, model, sequence, int(decode[1]))
        prompt = sequence + fresh_prompt(turn_seed * 10 + turn, 40)
