"""KV handoff from a context-parallel prefill node, without a transfer engine: each CP rank's pool
holds only the logical pages it owns (at ``page // N``), and its blocks (``local_pages`` +
``token_runs`` + ``route_blocks``) are copied byte for byte into a fake decode arena (TP 1 and TP 2),
which must then hold exactly the prompt's uncached tokens, each sent once, and nothing else. At
TP 2 x CP 2 each of the four prefill ranks holds, and sends, its tensor rank's heads of its pages.
Into a decode node with CP (``held_pages``), each decode rank gets only the pages it owns, at their
local slots, from any prefill layout (TP 1, CP 2, TP 2 x CP 2)."""

from __future__ import annotations

import numpy as np
import pytest

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.transfer.layout import (
    HeadRange,
    KVArena,
    RankArena,
    held_pages,
    local_pages,
    plan_routes,
    route_blocks,
    token_runs,
)

LAYERS, HEADS, HEAD_DIM, PAGE, LOCAL_PAGES = 2, 4, 3, 4, 6
HEAD_BYTES = HEAD_DIM * 4  # float32
LOGICAL = [5, 2, 7, 4, 9, 0, 3]  # a sequence's pages: rotation 1, 0, 1, 0, ... then 0, 1 (a cached path's)
DST_PAGES = [1, 2, 5, 0, 7, 3, 4]


def _copy(blocks: list[tuple[int, int, int]], src: np.ndarray, dst: dict[int, np.ndarray]) -> None:
    """Applies (source address, destination address, bytes) blocks; a destination's base is its high bits."""
    sbytes = src.reshape(-1).view(np.uint8)
    for s, d, n in blocks:
        dbytes = dst[d >> 32].reshape(-1).view(np.uint8)
        at = d & 0xFFFFFFFF
        dbytes[at: at + n] = sbytes[(s & 0xFFFFFFFFFF): (s & 0xFFFFFFFFFF) + n]


def _rank_pool(full: np.ndarray, own: PageOwnership, held: HeadRange) -> np.ndarray:
    """What CP rank ``own.rank`` holding ``held`` holds: those heads of the logical pages it owns,
    each at its local slot."""
    pool = np.zeros((LAYERS, 2, LOCAL_PAGES * PAGE * (2 // own.size), held.count, HEAD_DIM), dtype=np.float32)
    for page in (p for p in LOGICAL if own.owns(p)):
        local, logical = own.local(page) * PAGE, page * PAGE
        pool[:, :, local: local + PAGE] = full[:, :, logical: logical + PAGE, held.start:held.end]
    return pool


def _dests(d: int, cp: int) -> tuple[list[RankArena], dict[int, np.ndarray]]:
    """A decode node of ``d`` tensor ranks for each of ``cp`` CP ranks (each holding its own pages)."""
    places = [(PageOwnership(c, cp), HeadRange(r * HEADS // d, HEADS // d)) for c in range(cp) for r in range(d)]
    slots = 8 * PAGE
    arenas = [RankArena(f"d{i}", KVArena((i + 1) << 32, LAYERS, slots, h.count * HEAD_BYTES, PAGE), h, owner=o)
              for i, (o, h) in enumerate(places)]
    return arenas, {i + 1: np.zeros((LAYERS, 2, slots, h.count, HEAD_DIM), dtype=np.float32)
                    for i, (_, h) in enumerate(places)}


@pytest.mark.parametrize("p_tp", [1, 2])
@pytest.mark.parametrize(("p_cp", "d", "d_cp"), [(2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 1, 2), (2, 2, 2)])
@pytest.mark.parametrize(("start", "end"), [(0, 27), (8, 27), (4, 17)])
def test_each_cp_rank_sends_its_own_pages_and_together_every_token_once(p_tp: int, p_cp: int, d: int, d_cp: int,
                                                                         start: int, end: int) -> None:
    """A prefill node of ``p_tp`` x ``p_cp`` ranks into a decode node of ``d`` x ``d_cp``: each
    decode rank gets exactly its heads of the pages it owns, at their local slots."""
    rng = np.random.default_rng(start * 100 + end + d)
    full = rng.standard_normal((LAYERS, 2, 2 * LOCAL_PAGES * PAGE, HEADS, HEAD_DIM)).astype(np.float32)
    dests, dst_data = _dests(d, d_cp)
    sent = 0
    for rank, t in ((c, t) for c in range(p_cp) for t in range(p_tp)):
        own, held = PageOwnership(rank, p_cp), HeadRange(t * HEADS // p_tp, HEADS // p_tp)
        src = KVArena(1 << 40, LAYERS, LOCAL_PAGES * PAGE * (2 // p_cp), held.count * HEAD_BYTES, PAGE)
        for route in plan_routes(held, HEAD_BYTES, dests):
            runs = token_runs(local_pages(own, LOGICAL), held_pages(route.owner, DST_PAGES), start, end, PAGE)
            assert all(s // PAGE in {own.local(p) for p in LOGICAL if own.owns(p)} for s, _, _ in runs)
            blocks = [b for layer in range(LAYERS) for b in route_blocks(src, route, runs, layer)]
            _copy(blocks, _rank_pool(full, own, held), dst_data)
            sent += sum(n for _, _, n in blocks)
    for rank, dest in enumerate(dests):
        expected = np.zeros_like(dst_data[rank + 1])
        for token in (t for t in range(start, end) if dest.owner.owns(DST_PAGES[t // PAGE])):
            t = dest.owner.local(DST_PAGES[token // PAGE]) * PAGE + token % PAGE
            expected[:, :, t] = full[:, :, LOGICAL[token // PAGE] * PAGE + token % PAGE,
                                     dest.heads.start:dest.heads.end]
        np.testing.assert_array_equal(dst_data[rank + 1], expected)
    assert sent == (end - start) * LAYERS * 2 * HEADS * HEAD_BYTES


def test_without_cp_every_page_is_the_pool_s_own() -> None:
    assert local_pages(None, LOGICAL) == local_pages(PageOwnership(), LOGICAL) == LOGICAL
    assert local_pages(PageOwnership(1, 2), [5, 2, 7]) == [2, None, 3]
    assert held_pages(PageOwnership(), [5, 2, 7]) == [5, 2, 7]
    assert held_pages(PageOwnership(), [5, 2, 7], by_token=True) == [0, 1, 2]
    assert held_pages(PageOwnership(1, 2), [5, 2, 7]) == [2, None, 3]
    assert held_pages(PageOwnership(0, 2), [5, 2, 7], by_token=True) == [None, 0, None]  # its region packs its pages
