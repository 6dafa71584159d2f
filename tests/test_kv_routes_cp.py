"""KV handoff from a context-parallel prefill node, without a transfer engine: each CP rank's pool
holds only the logical pages it owns (at ``page // N``), and its blocks (``local_pages`` +
``token_runs`` + ``route_blocks``) are copied byte for byte into a fake decode arena (TP 1 and TP 2),
which must then hold exactly the prompt's uncached tokens, each sent once, and nothing else. At
TP 2 x CP 2 each of the four prefill ranks holds, and sends, its tensor rank's heads of its pages."""

from __future__ import annotations

import numpy as np
import pytest

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.transfer.layout import HeadRange, KVArena, RankArena, local_pages, plan_routes, route_blocks, token_runs

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
    pool = np.zeros((LAYERS, 2, LOCAL_PAGES * PAGE, held.count, HEAD_DIM), dtype=np.float32)
    for page in (p for p in LOGICAL if own.owns(p)):
        local, logical = own.local(page) * PAGE, page * PAGE
        pool[:, :, local: local + PAGE] = full[:, :, logical: logical + PAGE, held.start:held.end]
    return pool


def _dests(d: int) -> tuple[list[RankArena], dict[int, np.ndarray]]:
    heads = [HeadRange(r * HEADS // d, HEADS // d) for r in range(d)]
    slots = 8 * PAGE
    arenas = [RankArena(f"d{r}", KVArena((r + 1) << 32, LAYERS, slots, h.count * HEAD_BYTES, PAGE), h)
              for r, h in enumerate(heads)]
    return arenas, {r + 1: np.zeros((LAYERS, 2, slots, h.count, HEAD_DIM), dtype=np.float32)
                    for r, h in enumerate(heads)}


@pytest.mark.parametrize("p_tp", [1, 2])
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize(("start", "end"), [(0, 27), (8, 27), (4, 17)])
def test_each_cp_rank_sends_its_own_pages_and_together_every_token_once(p_tp: int, d: int, start: int,
                                                                         end: int) -> None:
    rng = np.random.default_rng(start * 100 + end + d)
    full = rng.standard_normal((LAYERS, 2, 2 * LOCAL_PAGES * PAGE, HEADS, HEAD_DIM)).astype(np.float32)
    dests, dst_data = _dests(d)
    sent = 0
    for rank, t in ((c, t) for c in range(2) for t in range(p_tp)):
        own, held = PageOwnership(rank, 2), HeadRange(t * HEADS // p_tp, HEADS // p_tp)
        src = KVArena(1 << 40, LAYERS, LOCAL_PAGES * PAGE, held.count * HEAD_BYTES, PAGE)
        runs = token_runs(local_pages(own, LOGICAL), DST_PAGES, start, end, PAGE)
        assert all(s // PAGE in {own.local(p) for p in LOGICAL if own.owns(p)} for s, _, _ in runs)
        for route in plan_routes(held, HEAD_BYTES, dests):
            blocks = [b for layer in range(LAYERS) for b in route_blocks(src, route, runs, layer)]
            _copy(blocks, _rank_pool(full, own, held), dst_data)
            sent += sum(n for _, _, n in blocks)
    for rank, dest in enumerate(dests):
        expected = np.zeros_like(dst_data[rank + 1])
        for token in range(start, end):
            t = DST_PAGES[token // PAGE] * PAGE + token % PAGE
            expected[:, :, t] = full[:, :, LOGICAL[token // PAGE] * PAGE + token % PAGE,
                                     dest.heads.start:dest.heads.end]
        np.testing.assert_array_equal(dst_data[rank + 1], expected)
    assert sent == (end - start) * LAYERS * 2 * HEADS * HEAD_BYTES


def test_without_cp_every_page_is_the_pool_s_own() -> None:
    assert local_pages(None, LOGICAL) == local_pages(PageOwnership(), LOGICAL) == LOGICAL
    assert local_pages(PageOwnership(1, 2), [5, 2, 7]) == [2, None, 3]
