"""KV handoff between TP sizes, without a transfer engine: every prefill rank's blocks (its KV heads,
``plan_routes`` + ``route_blocks``) are copied byte for byte into fake decode-rank arenas, which must
then hold exactly the prompt's tokens of their own heads, and nothing else was written."""

from __future__ import annotations

import numpy as np
import pytest

from tierserve.transfer.layout import (
    HeadRange,
    KVArena,
    RankArena,
    layer_blocks,
    plan_routes,
    route_blocks,
    token_runs,
)

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 2, 4, 3, 4, 6
HEAD_BYTES = HEAD_DIM * 4  # float32


def _split(size: int) -> list[HeadRange]:
    """Each rank's KV heads, replicated as the model splits them when ranks outnumber heads."""
    if size <= HEADS:
        return [HeadRange(r * (HEADS // size), HEADS // size) for r in range(size)]
    return [HeadRange(r // (size // HEADS), 1) for r in range(size)]


def _arena(rank: int, heads: HeadRange, base_shift: int) -> tuple[KVArena, np.ndarray]:
    data = np.zeros((LAYERS, 2, PAGES * PAGE, heads.count, HEAD_DIM), dtype=np.float32)
    return KVArena((rank + 1) << base_shift, LAYERS, PAGES * PAGE, heads.count * HEAD_BYTES, PAGE), data


def _copy(blocks: list[tuple[int, int, int]], src: dict[int, np.ndarray], dst: dict[int, np.ndarray]) -> None:
    """Applies (source address, destination address, bytes) blocks; the base is the high bits."""
    for s, d, n in blocks:
        sbytes, dbytes = src[s >> 40].reshape(-1).view(np.uint8), dst[d >> 32].reshape(-1).view(np.uint8)
        dbytes[d & 0xFFFFFFFF: (d & 0xFFFFFFFF) + n] = sbytes[s & 0xFFFFFFFFFF: (s & 0xFFFFFFFFFF) + n]


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 8), (4, 4)])
def test_every_decode_rank_gets_exactly_its_heads_of_the_new_tokens(p: int, d: int) -> None:
    rng = np.random.default_rng(p * 10 + d)
    full = rng.standard_normal((LAYERS, 2, PAGES * PAGE, HEADS, HEAD_DIM)).astype(np.float32)
    src_pages, dst_pages, start, end = [3, 4, 0, 5], [1, 2, 5, 0], 4, 15  # the first page was cached on D
    dests, dst_data = [], {}
    for rank, heads in enumerate(_split(d)):
        arena, data = _arena(rank, heads, 32)
        dests.append(RankArena(f"d{rank}", arena, heads))
        dst_data[rank + 1] = data
    runs = token_runs(src_pages, dst_pages, start, end, PAGE)
    sent, seen = 0, set()
    for rank, heads in enumerate(_split(p)):
        if heads.start in seen:
            continue  # a replica: the first rank holding the head sends it
        seen.add(heads.start)
        src, _ = _arena(rank, heads, 40)
        src_data = {rank + 1: np.ascontiguousarray(full[:, :, :, heads.start:heads.end])}
        for route in plan_routes(heads, HEAD_BYTES, dests):
            blocks = [b for layer in range(LAYERS) for b in route_blocks(src, route, runs, layer)]
            _copy(blocks, src_data, dst_data)
            sent += sum(n for _, _, n in blocks)
    for rank, dest in enumerate(dests):
        expected = np.zeros_like(dst_data[rank + 1])
        for token in range(start, end):
            s = src_pages[token // PAGE] * PAGE + token % PAGE
            t = dst_pages[token // PAGE] * PAGE + token % PAGE
            expected[:, :, t] = full[:, :, s, dest.heads.start:dest.heads.end]
        np.testing.assert_array_equal(dst_data[rank + 1], expected)
    held = sum(h.count for h in _split(d))  # a head replicated on several decode ranks goes to each
    assert sent == (end - start) * LAYERS * 2 * held * HEAD_BYTES


def test_the_same_tp_size_on_both_sides_moves_coalesced_runs() -> None:
    """TP=1 to TP=1 (and any equal split) keeps one block per run, as before heads were routed."""
    src = KVArena(1 << 40, LAYERS, 64, HEADS * HEAD_BYTES, PAGE)
    dst = RankArena("d", KVArena(1 << 32, LAYERS, 64, HEADS * HEAD_BYTES, PAGE), HeadRange(0, HEADS))
    (route,) = plan_routes(HeadRange(0, HEADS), HEAD_BYTES, [dst])
    runs = token_runs([0, 1, 2], [4, 5, 6], 0, 12, PAGE)
    assert route_blocks(src, route, runs, 1) == layer_blocks(src, dst.arena, runs, 1)
    assert len(runs) == 1


def test_a_head_sub_range_is_one_block_per_token() -> None:
    """Prefill TP=2 into decode TP=1: each token's slot on D holds both ranks' heads side by side."""
    src = KVArena(1 << 40, LAYERS, 64, 2 * HEAD_BYTES, PAGE)
    dst = RankArena("d", KVArena(1 << 32, LAYERS, 64, HEADS * HEAD_BYTES, PAGE), HeadRange(0, HEADS))
    (route,) = plan_routes(HeadRange(2, 2), HEAD_BYTES, [dst])
    assert (route.src_offset, route.dst_offset, route.nbytes) == (0, 2 * HEAD_BYTES, 2 * HEAD_BYTES)
    assert len(route_blocks(src, route, token_runs([0, 1], [4, 5], 0, 8, PAGE), 0)) == 2 * 8
