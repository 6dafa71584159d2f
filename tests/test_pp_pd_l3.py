"""Prefill and decode nodes with pipeline stages, HiCache (L1, L2) and L3 on a real
``mooncake_master`` (issue 15, items 8 and 9): real node processes driven through gRPC as the router
drives them. Answers equal the single engine's; a repeated prompt hits L1, then L2, on a PP=2 prefill
node, and once its L1 and L2 are flushed it comes at least 90% from L3 (every stage reading its layer
range); a decode node offloads what it generated to L3 by stage (PP=2) or whole (PP=1), and the PP=2
prefill node reads it back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, PAGE, reference
from helpers.polling import wait_for
from helpers.processes import MasterProcess, NodeProcess
from helpers.tiny_models import make_tiny_model
from test_tp_pd_l3 import OFFLOAD_DEADLINE_S, flush, fresh_prompt, hicache_args, pd

from tierserve.cache.hashing import Namespace, page_keys
from tierserve.cache.options import HostLayout, object_format
from tierserve.cache.sharded.shards import HeadRange, LayerRange, object_key
from tierserve.model.identity import model_identity

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYERS, KV_HEADS = 4, 4  # PP 2 stages hold 2 layers each


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pp_pd_l3"), heads=8, kv_heads=KV_HEADS, layers=LAYERS,
                           max_position=2048)


@pytest.fixture(scope="module")
def nodes(model: Path, module_master: MasterProcess, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """A PP 2 prefill node "pp2" and decode nodes at PP 2 ("dp2") and PP 1 ("d1"), all on one L3."""
    logs = tmp_path_factory.mktemp("pp-pd-l3-logs")
    plan = {"pp2": ("prefill", NODE_ARGS, 2), "dp2": ("decode", DECODE_ARGS, 2), "d1": ("decode", DECODE_ARGS, 1)}
    l3 = hicache_args(module_master)
    started = {name: NodeProcess(role, ["--model", str(model), *args, *l3, "--pp-size", str(pp)], logs / f"{name}.log")
               for name, (role, args, pp) in plan.items()}
    try:
        yield {name: node.wait_ready() for name, node in started.items()}
    finally:
        for node in started.values():
            node.stop()


def l3_names(model: Path, tokens: list[int], pp_size: int) -> list[bytes]:
    """The L3 objects a TP 1 node of ``pp_size`` stages writes for the full pages of ``tokens``: one
    per page and stage, named by the stage's layer range."""
    seed = Namespace(model_identity(model), "float32", PAGE, LAYERS, KV_HEADS, 16,
                     object_format(HostLayout.PAGE_FIRST_DIRECT)).seed()
    per = LAYERS // pp_size
    keys = page_keys(seed, tokens[: len(tokens) // PAGE * PAGE], PAGE)
    return [object_key(k, HeadRange(0, KV_HEADS, KV_HEADS), LayerRange(s * per, per, LAYERS))
            for k in keys for s in range(pp_size)]


def test_prefill_at_pp2_hits_l1_then_l2_then_l3(model: Path, nodes) -> None:
    prompt = fresh_prompt(1, 150)  # 9 full pages
    expected = reference(model, [prompt])[0]
    answer, cache = pd(nodes, "pp2", "dp2", "tiers-0", prompt)
    assert answer == expected and cache.cached_tokens == 0, cache
    answer, cache = pd(nodes, "pp2", "dp2", "tiers-1", prompt)
    assert answer == expected and cache.device >= 0.9 * len(prompt), cache
    assert asyncio.run(flush(nodes["pp2"].address, host=False)).device_pages > 0  # L2 keeps its copies
    answer, cache = pd(nodes, "pp2", "dp2", "tiers-2", prompt)
    assert answer == expected and cache.host >= 0.9 * len(prompt) and cache.storage == 0, cache
    flushed = asyncio.run(flush(nodes["pp2"].address))
    assert flushed.device_pages > 0 and flushed.host_pages > 0  # only L3 can serve the prompt now
    answer, cache = pd(nodes, "pp2", "dp2", "tiers-3", prompt)
    assert answer == expected and cache.storage >= 0.9 * len(prompt), cache


@pytest.mark.parametrize(("decode", "turn_seed"), [("dp2", 2), ("d1", 3)])
def test_decode_offloads_by_stage_and_prefill_at_pp2_reads_it(model: Path, nodes, l3_store, decode: str,
                                                               turn_seed: int) -> None:
    """Each turn's prompt is the last turn's prompt and answer plus new words; the answer's KV
    exists only on the decode node, so L3 has it only if that node offloaded it."""
    pp_size = 2 if decode == "dp2" else 1
    prompt = fresh_prompt(turn_seed, 120)
    previous = -1
    for turn in range(3):
        if turn:
            asyncio.run(flush(nodes["pp2"].address))  # only L3 can serve the history
        answer, cache = pd(nodes, "pp2", decode, f"{decode}-turn-{turn}", prompt)
        assert answer == reference(model, [prompt])[0], turn
        if turn:
            assert cache.storage == cache.cached_tokens > previous, (turn, cache)
            assert cache.cached_tokens >= len(prompt) - 40 - PAGE, (turn, cache)  # reaches into the answer
        previous = cache.cached_tokens
        sequence = prompt + answer
        names = l3_names(model, sequence[:-1], pp_size)  # the last token has no KV yet
        wait_for(lambda names=names: l3_store.batch_exists(names) == len(names),
                 f"a PP {pp_size} decode node offloads to L3", OFFLOAD_DEADLINE_S)
        prompt = sequence + fresh_prompt(turn_seed * 10 + turn, 40)
