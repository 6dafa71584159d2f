"""Prefill and decode nodes of different TP sizes (issue 14, item 4) or pipeline stages (issue 15,
item 9) hand KV to each other: real node processes (each rank its own transfer engine over TCP; with
stages, each stage's arena holding its layers only), driven through gRPC as the router drives them.
Outputs equal the single engine; the handoff moves exactly the KV bytes of the uncached prompt; a
destination that cannot be written (heads or layers with no rank) is refused with a clear error.

Each layout ("tp", "pp", "ppu") starts "p2" and "d2" of several ranks once for the module (TP 2 and PP 2
at TP 1, both on 4 layers; "ppu": PP 3 on 5 layers, uneven stages of 2, 2 and 1 layers, the default
split); "p1" and "d1", of one rank, are started once per model, so "tp" and "pp" share theirs. A prefill
node of a given partition (1 + 4 layers) hands over to the uneven PP 3 node and the reverse, no stage
boundary shared."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from helpers.injected_faults import node_env, write_faults
from helpers.pd_nodes import (
    DECODE_ARGS,
    NODE_ARGS,
    PAGE,
    greedy,
    idle,
    info,
    load,
    prefill_into,
    prompts,
    reference,
    release,
    reserve,
    reserve_for,
    run_all,
    run_pd,
)
from helpers.polling import wait_for
from helpers.processes import NodeProcess, stop_all
from helpers.tiny_models import make_tiny_model

from tierserve.router import pd_flow

pytestmark = pytest.mark.integration
LAYERS = {"tp": 4, "pp": 4, "ppu": 5}  # two stages of two layers at PP 2; 2 + 2 + 1 at PP 3
MULTI = {"tp": 2, "pp": 2, "ppu": 3}  # the ranks of "p2" and "d2"


def token_bytes(layout: str) -> int:
    """layers x (K, V) x the model's 4 KV heads x head dim x float32"""
    return LAYERS[layout] * 2 * 4 * 16 * 4


def sizes(layout: str, ranks: int) -> list[str]:
    """The flags of a node of ``ranks`` ranks in ``layout`` (PP: at TP 1)."""
    return ["--tp-size", str(ranks)] if layout == "tp" else ["--tp-size", "1", "--pp-size", str(ranks)]


@contextmanager
def node_pair(args: list[str], logs: Path, name: str) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A prefill and a decode node started with ``args`` (their logs ``p<name>.log`` and
    ``d<name>.log`` under ``logs``), ready, and stopped when the block ends."""
    prefill = NodeProcess("prefill", [*NODE_ARGS, *args], logs / f"p{name}.log")
    decode = NodeProcess("decode", [*DECODE_ARGS, *args], logs / f"d{name}.log")
    try:
        prefill.wait_ready(), decode.wait_ready()
        yield prefill, decode
    finally:
        stop_all((prefill.proc, decode.proc))


@pytest.fixture(scope="module", params=["tp", "pp", "ppu"])
def layout(request) -> str:
    """The ranks' layout; a test of one layout only names it with ``ONLY_TP`` or ``ONLY_PP``."""
    return request.param


ONLY_TP = pytest.mark.parametrize("layout", ["tp"], indirect=True)
ONLY_PP = pytest.mark.parametrize("layout", ["pp"], indirect=True)
ONLY_UNEVEN = pytest.mark.parametrize("layout", ["ppu"], indirect=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, Path]:
    """The module's tiny Llamas (8 heads, 4 KV heads) by their number of layers, each made once."""
    return {layers: make_tiny_model("llama", tmp_path_factory.mktemp(f"pd_llama{layers}"), heads=8, kv_heads=4,
                                    layers=layers, max_position=2048)
            for layers in sorted(set(LAYERS.values()))}


@pytest.fixture(scope="module")
def model(models: dict[int, Path], layout: str) -> Path:
    return models[LAYERS[layout]]


def _start(model: Path, ranks_flags: list[str], logs: Path, name: str) -> dict[str, NodeProcess]:
    """A prefill node ``p<name>`` and a decode node ``d<name>`` of ``model``, started (not yet ready),
    their logs under ``logs``."""
    return {f"{role[0]}{name}": NodeProcess(role, ["--model", str(model), *args, *ranks_flags],
                                            logs / f"{role}-{name}.log")
            for role, args in (("prefill", NODE_ARGS), ("decode", DECODE_ARGS))}


@pytest.fixture(scope="module")
def one_rank_nodes(models: dict[int, Path], tmp_path_factory) -> Iterator[Callable[[Path], dict[str, NodeProcess]]]:
    """"p1" and "d1" (one rank: the same node whatever the layout) of a model, started on first use and
    kept for the module: the "tp" and "pp" layouts share the 4-layer model's."""
    started: dict[Path, dict[str, NodeProcess]] = {}

    def of(model: Path) -> dict[str, NodeProcess]:
        if model not in started:
            started[model] = _start(model, sizes("tp", 1), tmp_path_factory.mktemp(f"{model.name}-logs"), "1")
        return {name: node.wait_ready() for name, node in started[model].items()}

    try:
        yield of
    finally:
        stop_all(node.proc for pair in started.values() for node in pair.values())


@pytest.fixture(scope="module")
def nodes(model: Path, layout: str, one_rank_nodes, tmp_path_factory) -> Iterator[dict[str, NodeProcess]]:
    """Prefill and decode nodes of one rank and of ``MULTI`` ranks: "p1", "p2", "d1", "d2"."""
    multi = _start(model, sizes(layout, MULTI[layout]), tmp_path_factory.mktemp(f"{layout}-pd-logs"), "2")
    try:
        yield {**one_rank_nodes(model), **{name: node.wait_ready() for name, node in multi.items()}}
    finally:
        stop_all(node.proc for node in multi.values())


def _check_pairing(model: Path, layout: str, prefill: str, decode: str, seed: int, tag: str) -> None:
    """Fresh prompts through the pair: the single engine's answers, every head of every layer of
    every token sent once, and every page (and staging byte) back on both nodes."""
    batch = prompts(4, seed=seed)
    results = asyncio.run(run_all(prefill, decode, batch, tag))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * token_bytes(layout) for p in batch]
    wait_for(lambda: idle(prefill, decode), "every page back on both nodes", 10)


@pytest.mark.parametrize(("p", "d"), [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_outputs_equal_the_single_engine_across_sizes(model: Path, layout: str, nodes, p: str, d: str) -> None:
    # fresh prompts: no decode node caches them
    seed = {"tp": 0, "pp": 100, "ppu": 300}[layout] + int(p[1]) * 10 + int(d[1])
    _check_pairing(model, layout, nodes[p].address, nodes[d].address, seed, f"{p}{d}-")


def test_a_decode_cache_hit_moves_only_the_uncached_tokens(model: Path, layout: str, nodes) -> None:
    prompt = prompts(1, seed={"tp": 11, "pp": 12, "ppu": 13}[layout])[0] + list(range(2, 2 + 3 * PAGE))
    first, r1 = asyncio.run(run_pd(nodes["p2"].address, nodes["d2"].address, "hit-a", prompt))
    again, r2 = asyncio.run(run_pd(nodes["p1"].address, nodes["d2"].address, "hit-b", prompt))
    assert first == again == reference(model, [prompt])[0]
    held = (len(prompt) - 1) // PAGE * PAGE  # whole pages below the last token, kept by D's radix cache
    assert r1.transferred_bytes == len(prompt) * token_bytes(layout)
    assert r2.transferred_bytes == (len(prompt) - held) * token_bytes(layout)


def test_a_destination_missing_a_rank_is_refused_with_a_clear_error(layout: str, nodes) -> None:
    """As if the decode node lacked its rank 1: TP, heads 2 and 3 would go nowhere; PP, layers 2
    and 3 (of 4; of 5 at PP 3)."""
    prompt = list(range(2, 40))
    dest = asyncio.run(reserve(nodes["d2"].address, "half", prompt)).destination
    del dest.ranks[1]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(prefill_into(nodes["p2"].address, "half", prompt, dest))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert {"tp": "hold no copy of KV heads [2, 3]", "pp": "holds layers [2, 3] of 4 of KV head 0",
            "ppu": "holds layers [2, 3] of 5 of KV head 0"}[layout] in refused.value.details()
    asyncio.run(release(nodes["d2"].address, "half", True))


def test_info_reports_the_sizes(layout: str, nodes) -> None:
    infos = [asyncio.run(info(nodes[n].address)) for n in ("p1", "p2", "d1", "d2")]
    assert [(i.tp_size, i.pp_size) for i in infos] == {"tp": [(1, 1), (2, 1), (1, 1), (2, 1)],
                                                      "pp": [(1, 1), (1, 2), (1, 1), (1, 2)],
                                                      "ppu": [(1, 1), (1, 3), (1, 1), (1, 3)]}[layout]


def test_the_destination_names_every_decode_rank(layout: str, nodes) -> None:
    """TP: each rank's heads, a transfer engine per rank. PP: each stage's layers (of every head);
    one rank holds them all; each stage's rank stages for TP 2 writers of its layers."""
    if layout == "tp":
        dest = asyncio.run(reserve(nodes["d2"].address, "ranks", list(range(2, 40)))).destination
        assert [(r.kv_head_start, r.kv_heads) for r in dest.ranks] == [(0, 2), (2, 2)]
        assert len({r.transfer_endpoint for r in dest.ranks}) == 2  # a transfer engine per rank
        assert dest.transfer_endpoint == dest.ranks[0].transfer_endpoint
        asyncio.run(release(nodes["d2"].address, "ranks", True))
        return
    dest = asyncio.run(reserve(nodes["d2"].address, "pp-ranks", list(range(2, 40)))).destination
    stages = {"pp": [(0, 2), (2, 2)], "ppu": [(0, 2), (2, 2), (4, 1)]}[layout]  # ppu: the default split, 2 + 2 + 1
    assert [(r.layer_start, r.num_layers, r.kv_head_start, r.kv_heads) for r in dest.ranks] == [
        (*s, 0, 4) for s in stages]
    asyncio.run(release(nodes["d2"].address, "pp-ranks", True))
    (whole,) = asyncio.run(reserve(nodes["d1"].address, "pp-one", list(range(2, 40)))).destination.ranks
    assert (whole.layer_start, whole.num_layers) == (0, LAYERS[layout])
    asyncio.run(release(nodes["d1"].address, "pp-one", True))
    staged = asyncio.run(reserve_for(nodes["d2"].address, "pp-staged", list(range(2, 40)), source_tp=2)).destination
    asyncio.run(release(nodes["d2"].address, "pp-staged", True))
    assert [[(s.kv_head_start, s.kv_heads, s.tokens) for s in r.staged] for r in staged.ranks] == [
        [(0, 2, 38), (2, 2, 38)]] * len(stages)


# ---- TP only: staging between TP sizes, replicated heads, long prompts ------------------------


@ONLY_TP
def test_long_prompts_between_tp_sizes_fit_the_transfer_engines_limits(model: Path, layout: str, nodes) -> None:
    """Without staging (a Reserve that does not name the prefill node's TP size) head sub-ranges
    move one block per token: 1,200-token prompts make 2,400 blocks per layer and rank, above what
    one Mooncake engine takes in flight, three at once on the same engines."""
    batch = [[2 + (i * 31 + j * 7) % 380 for j in range(1200)] for i in range(3)]
    results = asyncio.run(run_all(nodes["p2"].address, nodes["d1"].address, batch, "long-", source_tp=0))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    assert [r.transferred_bytes for _, r in results] == [len(p) * token_bytes(layout) for p in batch]


@ONLY_TP
def test_a_decode_rank_stages_what_prefill_ranks_of_fewer_heads_write(layout: str, nodes) -> None:
    """D1 reserved for a TP=2 writer offers a staged part per prefill rank's heads (so each writes
    whole slots of its own, coalesced); the staging goes back when the reservation ends."""
    dest = asyncio.run(reserve_for(nodes["d1"].address, "staged", list(range(2, 40)), source_tp=2)).destination
    assert [(s.kv_head_start, s.kv_heads, s.tokens) for s in dest.ranks[0].staged] == [(0, 2, 38), (2, 2, 38)]
    assert asyncio.run(load(nodes["d1"].address)).staging_bytes_used >= 2 * 2 * 38 * 4 * 16 * 4
    asyncio.run(release(nodes["d1"].address, "staged", True))
    assert asyncio.run(load(nodes["d1"].address)).staging_bytes_used == 0
    same = asyncio.run(reserve_for(nodes["d2"].address, "same", list(range(2, 40)), source_tp=2)).destination
    assert [list(r.staged) for r in same.ranks] == [[], []]  # the same split: in place
    asyncio.run(release(nodes["d2"].address, "same", True))


@ONLY_TP
def test_a_prefill_node_of_another_tp_size_than_the_reserve_named_is_refused(layout: str, nodes) -> None:
    """D staged for TP=2 writers; a TP=1 prefill node would leave the parts unwritten and D would
    scatter them over the pages: refused before anything is computed or sent."""
    prompt = list(range(2, 40))
    dest = asyncio.run(reserve_for(nodes["d1"].address, "wrong-tp", prompt, source_tp=2)).destination
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(prefill_into(nodes["p1"].address, "wrong-tp", prompt, dest))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another prefill TP size than this node's 1" in refused.value.details()
    asyncio.run(release(nodes["d1"].address, "wrong-tp", True))


@ONLY_TP
@pytest.mark.slow
def test_every_decode_rank_scatters_its_staging_at_the_same_offset(model: Path, layout: str, nodes,
                                                                   tmp_path: Path) -> None:
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
    assert [r.transferred_bytes for _, r in results] == [len(p) * token_bytes(layout) for p in batch]
    dest = asyncio.run(reserve_for(nodes["d2"].address, "p4-parts", list(range(2, 40)), source_tp=4)).destination
    asyncio.run(release(nodes["d2"].address, "p4-parts", True))
    assert [[s.kv_head_start for s in r.staged] for r in dest.ranks] == [[0, 1], [2, 3]]


LAG_S = 3.0  # decode rank 1 applies every take this late (test-only ``lag_commands``)


@ONLY_TP
@pytest.mark.slow
def test_a_rank_late_to_scatter_still_reads_its_own_requests_kv(model: Path, layout: str, tmp_path: Path) -> None:
    """Rank 0 applies a command, and answers a Reserve, before the other ranks apply it (with the next
    step's message). Here decode rank 1 applies every take (``StartReserved``) ``LAG_S`` late, as a
    slow or stopped stage does: request b is taken in the same turn as c is reserved, so c's staging
    lies at b's offset, and c's prefill node writes there while rank 1 is yet to scatter b's KV out
    of it. b must still answer as the single engine (issue 31: a TP 2 prefill -> PP 2 decode cluster
    answered wrong 1 to 2 times in 1,000; without ``ScatterFence`` b decodes over c's KV in rank 1's
    heads)."""
    faults = write_faults(tmp_path / "faults.json", lag={"StartReserved": LAG_S})
    prefill = NodeProcess("prefill", ["--model", str(model), *NODE_ARGS, "--tp-size", "4"], tmp_path / "p4.log")
    decode = NodeProcess("decode", ["--model", str(model), *DECODE_ARGS, "--tp-size", "2"], tmp_path / "d2.log",
                         env=node_env(faults))
    a, b, c = ([rng.randrange(2, 384) for _ in range(40)] for rng in [random.Random(51)] * 3)  # one length: one layout
    try:
        prefill.wait_ready(), decode.wait_ready()
        got = asyncio.run(_taken_while_the_next_is_reserved(prefill.address, decode.address, a, b, c))
    finally:
        stop_all((prefill.proc, decode.proc))
    assert got == reference(model, [b])[0]


async def _taken_while_the_next_is_reserved(prefill: str, decode: str, a: list[int], b: list[int], c: list[int]
                                            ) -> list[int]:
    """b reserved first (its staging at the arena's start) and a, both handed over; then a's Generate
    holds rank 0 in a step until rank 1 applied its late take, while b's Generate and then c's Reserve
    queue behind it: rank 0 takes b and reserves c in one turn. Returns b's tokens."""
    async with grpc.aio.insecure_channel(prefill) as p, grpc.aio.insecure_channel(decode) as d:
        pair = pd_flow.Pair.connect(p, d)
        done_b, done_a = [await pd_flow.prefill(pair, rid, prompt, greedy(), timeout_s=60, source_tp=4)
                          for rid, prompt in (("b", b), ("a", a))]

        async def tokens(done: pd_flow.Prefilled) -> list[int]:
            return [t async for chunk in pd_flow.generate(pair, done, greedy()) for t in chunk.token_ids]

        runs = [asyncio.create_task(tokens(done_a))]
        await asyncio.sleep(LAG_S / 6)  # rank 0 is in a step waiting for rank 1 (ordering only, no result read)
        runs.append(asyncio.create_task(tokens(done_b)))
        await asyncio.sleep(LAG_S / 6)  # b's take queued first, c's Reserve behind it
        done_c = await pd_flow.prefill(pair, "c", c, greedy(), timeout_s=60, source_tp=4)
        runs.append(asyncio.create_task(tokens(done_c)))
        return (await asyncio.gather(*runs))[1]


# ---- PP only: stages between TP sizes ---------------------------------------------------------


@ONLY_PP
@pytest.mark.slow
def test_stages_hand_over_between_tp_sizes_through_staging(model: Path, layout: str, nodes, tmp_path: Path) -> None:
    """TP 2 x PP 2 on one side, TP 1 x PP 2 on the other: each stage's ranks of fewer heads write
    into the decode rank's staging (P > D), or each stage's rank of more heads gathers (P < D)."""
    args = ["--model", str(model), "--tp-size", "2", "--pp-size", "2"]
    with node_pair(args, tmp_path, "t2p2") as (prefill, decode):
        _check_pairing(model, layout, prefill.address, nodes["d2"].address, 201, "t2p2-dp2-")
        _check_pairing(model, layout, nodes["p2"].address, decode.address, 202, "pp2-dt2p2-")
        _check_pairing(model, layout, prefill.address, nodes["d1"].address, 203, "t2p2-d1-")


@ONLY_UNEVEN
@pytest.mark.slow
def test_a_given_partition_hands_over_to_and_from_uneven_stages(model: Path, layout: str, nodes,
                                                                 tmp_path: Path) -> None:
    """Prefill and decode nodes of ``--pp-layer-partition 1,4`` against the PP 3 nodes (2 + 2 + 1):
    each stage sends each of its layers to whichever stage holds it."""
    args = ["--model", str(model), "--pp-size", "2", "--pp-layer-partition", "1,4"]
    with node_pair(args, tmp_path, "14") as (prefill, decode):
        _check_pairing(model, layout, prefill.address, nodes["d2"].address, 401, "p14-d3-")
        _check_pairing(model, layout, nodes["p2"].address, decode.address, 402, "p3-d14-")
        (first, second) = asyncio.run(reserve(decode.address, "p14-ranks", list(range(2, 40)))).destination.ranks
        asyncio.run(release(decode.address, "p14-ranks", True))
    assert [(r.layer_start, r.num_layers) for r in (first, second)] == [(0, 1), (1, 4)]


def test_a_kv_head_replicated_on_both_sides_is_sent_once_per_decode_rank(tmp_path: Path) -> None:
    """One KV head, TP 2 on both sides: both prefill ranks hold it, only the first sends it; both
    decode ranks hold it, each gets its own copy (so twice the model's bytes arrive)."""
    model = make_tiny_model("qwen3", tmp_path / "qwen3", heads=4, kv_heads=1, max_position=2048)
    args = ["--model", str(model), "--tp-size", "2"]
    with node_pair(args, tmp_path, "") as (prefill, decode):
        batch = prompts(3, seed=9)
        results = asyncio.run(run_all(prefill.address, decode.address, batch, "replica-"))
    assert [tokens for tokens, _ in results] == reference(model, batch)
    one_head = 2 * 2 * 1 * 16 * 4  # layers x (K, V) x 1 KV head x head dim x float32
    assert [r.transferred_bytes for _, r in results] == [2 * len(p) * one_head for p in batch]
