"""KV handoff between pipeline-parallel (and TP) sizes, without a transfer engine: each prefill
rank's blocks (its heads of its stage's layers, ``plan_routes`` with its ``LayerRange`` +
``route_blocks``) are copied byte for byte into fake decode-rank arenas of their own stages' layers,
which must then hold exactly the prompt's tokens of their heads and layers, each sent once."""

from __future__ import annotations

import numpy as np
import pytest

from tierserve.transfer.layout import HeadRange, KVArena, LayerRange, RankArena, plan_routes, route_blocks, token_runs

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 4, 4, 3, 4, 6
HEAD_BYTES = HEAD_DIM * 4  # float32
SRC_PAGES, DST_PAGES, START, END = [3, 4, 0, 5], [1, 2, 5, 0], 4, 15  # the first page was cached on D


def _ranks(tp: int, pp: int) -> list[tuple[HeadRange, LayerRange]]:
    """Rank s * tp + t: tensor rank t of stage s, as ``stage_of`` places them."""
    per = LAYERS // pp
    return [(HeadRange(t * (HEADS // tp), HEADS // tp), LayerRange(s * per, per)) for s in range(pp) for t in range(tp)]


def _arena(rank: int, heads: HeadRange, layers: LayerRange, base_shift: int) -> tuple[KVArena, np.ndarray]:
    data = np.zeros((layers.count, 2, PAGES * PAGE, heads.count, HEAD_DIM), dtype=np.float32)
    return KVArena((rank + 1) << base_shift, layers.count, PAGES * PAGE, heads.count * HEAD_BYTES, PAGE), data


def _copy(blocks: list[tuple[int, int, int]], src: dict[int, np.ndarray], dst: dict[int, np.ndarray]) -> None:
    """Applies (source address, destination address, bytes) blocks; the base is the high bits."""
    for s, d, n in blocks:
        sbytes, dbytes = src[s >> 40].reshape(-1).view(np.uint8), dst[d >> 32].reshape(-1).view(np.uint8)
        dbytes[d & 0xFFFFFFFF: (d & 0xFFFFFFFF) + n] = sbytes[s & 0xFFFFFFFFFF: (s & 0xFFFFFFFFFF) + n]


def _destinations(tp: int, pp: int) -> tuple[list[RankArena], dict[int, np.ndarray]]:
    dests, data = [], {}
    for rank, (heads, layers) in enumerate(_ranks(tp, pp)):
        arena, data[rank + 1] = _arena(rank, heads, layers, 32)
        dests.append(RankArena(f"d{rank}", arena, heads, first_layer=layers.start))
    return dests, data


def _send(full: np.ndarray, tp: int, pp: int, dests: list[RankArena], dst_data: dict[int, np.ndarray]) -> int:
    """Every prefill rank's blocks of every layer it holds, applied; the bytes sent."""
    runs, sent = token_runs(SRC_PAGES, DST_PAGES, START, END, PAGE), 0
    for rank, (heads, layers) in enumerate(_ranks(tp, pp)):
        src, _ = _arena(rank, heads, layers, 40)
        own = {rank + 1: np.ascontiguousarray(full[layers.start:layers.end, :, :, heads.start:heads.end])}
        for route in plan_routes(heads, HEAD_BYTES, dests, layers):
            blocks = [b for layer in range(layers.count) if layer in route.layers
                      for b in route_blocks(src, route, runs, layer)]
            _copy(blocks, own, dst_data)
            sent += sum(n for _, _, n in blocks)
    return sent


@pytest.mark.parametrize(("p", "d"), [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((1, 2), (1, 2)), ((1, 4), (1, 2)),
                                      ((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 2), (4, 1)), ((4, 2), (2, 4))])
def test_every_decode_rank_gets_exactly_its_heads_of_its_layers(p: tuple[int, int], d: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(p) * 10 + sum(d))
    full = rng.standard_normal((LAYERS, 2, PAGES * PAGE, HEADS, HEAD_DIM)).astype(np.float32)
    dests, dst_data = _destinations(*d)
    sent = _send(full, *p, dests, dst_data)
    for rank, dest in enumerate(dests):
        expected = np.zeros_like(dst_data[rank + 1])
        for token in range(START, END):
            s = SRC_PAGES[token // PAGE] * PAGE + token % PAGE
            t = DST_PAGES[token // PAGE] * PAGE + token % PAGE
            expected[:, :, t] = full[dest.layers.start:dest.layers.end, :, s, dest.heads.start:dest.heads.end]
        np.testing.assert_array_equal(dst_data[rank + 1], expected)
    assert sent == (END - START) * LAYERS * 2 * HEADS * HEAD_BYTES  # every head of every layer, once


def test_a_stage_routes_only_to_the_ranks_holding_its_layers() -> None:
    """Prefill stage 1 of 2 (layers 2, 3) into decode stages of one layer each: ranks 2 and 3 only,
    its arena's layer 0 into each one's layer 0 (the model's layers 2 and 3)."""
    dests, _ = _destinations(1, 4)
    routes = plan_routes(HeadRange(0, HEADS), HEAD_BYTES, dests, LayerRange(2, 2))
    assert [(r.target, list(r.layers), r.layer_shift) for r in routes] == [("d2", [0], 0), ("d3", [1], -1)]
    assert plan_routes(HeadRange(0, HEADS), HEAD_BYTES, dests, None)[3].layers == range(3, 4)  # no stages: from 0
