"""Coalesced handoffs between TP sizes (``transfer/staging.py``, ``transfer/receive_staging.py``): the
blocks a prefill rank would submit are applied with ``memmove`` between real tensors (the transfer
engine's job), and every decode rank must then hold exactly its heads of the sent tokens, with one
block per run of consecutive slots rather than one per token."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.core.transfer import TransferProtocol
from tierserve.node.convert import staging_problem
from tierserve.transfer.engine import PeerEngines, TransferEngineHandle
from tierserve.transfer.faulty import HandoffFaults, with_faults
from tierserve.transfer.handoff import HandoffResult, KVHandoff
from tierserve.transfer.layout import (
    HeadRange,
    KVArena,
    RankArena,
    held_pages,
    plan_routes,
    route_blocks,
    staged_slots,
    token_runs,
)
from tierserve.transfer.receive_staging import ReceiveStaging, staged_heads
from tierserve.transfer.staging import Gatherer, StagingArena, gathers

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 4, 3, 4, 8
HEAD_BYTES = DIM * 4
SRC_PAGES, DST_PAGES, START, END = [3, 4, 0, 5, 6], [1, 2, 5, 6, 7], 4, 19  # D cached the first page


def _split(size: int) -> list[HeadRange]:
    """Each rank's KV heads as the model splits them (replicated when ranks outnumber heads)."""
    if size <= HEADS:
        return [HeadRange(r * (HEADS // size), HEADS // size) for r in range(size)]
    return [HeadRange(r // (size // HEADS), 1) for r in range(size)]


def _pool(heads: int) -> tuple[torch.Tensor, KVArena]:
    pool = torch.zeros(LAYERS, 2, PAGES * PAGE, heads, DIM)
    return pool, KVArena(pool.data_ptr(), LAYERS, PAGES * PAGE, heads * HEAD_BYTES, PAGE)


def _apply(blocks: list[tuple[int, int, int]]) -> None:
    for src, dst, n in blocks:
        ctypes.memmove(dst, src, n)


WHOLE = PageOwnership()  # a decode rank without CP: every page


def _expected(full: torch.Tensor, heads: HeadRange, owner: PageOwnership = WHOLE) -> torch.Tensor:
    """What a decode rank holding ``heads`` of ``owner``'s pages (each at its local slot) must hold."""
    out = torch.zeros(LAYERS, 2, PAGES * PAGE, heads.count, DIM)
    for t in (t for t in range(START, END) if owner.owns(DST_PAGES[t // PAGE])):
        s, d = SRC_PAGES[t // PAGE] * PAGE + t % PAGE, owner.local(DST_PAGES[t // PAGE]) * PAGE + t % PAGE
        out[:, :, d] = full[:, :, s, heads.start:heads.end]
    return out


def _decode(d: int, source_tp: int, cp: int = 1, staging_bytes: int = 1 << 20
            ) -> tuple[list[RankArena], list[torch.Tensor], list[ReceiveStaging]]:
    """Decode ranks (``d`` tensor ranks of each of ``cp`` CP ranks) with ``staging_bytes`` of
    staging each for a writer of ``source_tp`` ranks, reserved as a node would."""
    dests, pools, receives = [], [], []
    for owner, heads in ((PageOwnership(c, cp), h) for c in range(cp) for h in _split(d)):
        pool, arena = _pool(heads.count)
        receive = ReceiveStaging(StagingArena(staging_bytes), pool, arena, heads, HEADS, owner)
        receive.stage("r", DST_PAGES, END, source_tp)
        parts = tuple(receive.parts("r", receive.staging.base, heads))
        dests.append(RankArena(f"d{len(dests)}", arena, heads, parts, receive.staging.base, owner=owner))
        pools.append(pool)
        receives.append(receive)
    return dests, pools, receives


def _send(p: int, full: torch.Tensor, dests: list[RankArena]) -> list[int]:
    """Every sending prefill rank's blocks applied; returns each route's blocks per layer."""
    counts = []
    for heads in dict.fromkeys(_split(p)):
        pool = full[:, :, :, heads.start:heads.end].contiguous()
        src = KVArena(pool.data_ptr(), LAYERS, PAGES * PAGE, heads.count * HEAD_BYTES, PAGE)
        gatherer = Gatherer(StagingArena(1 << 20), pool, src)
        for route in plan_routes(heads, HEAD_BYTES, dests):
            dst_pages = held_pages(route.owner, DST_PAGES, route.by_token)
            runs = token_runs(SRC_PAGES, dst_pages, START, END, PAGE)
            for layer in range(LAYERS):
                if gathers(src, route):
                    _, blocks = gatherer.stage(route, runs, layer, 0.0)
                else:
                    blocks = route_blocks(src, route, runs, layer)
                _apply(blocks)
                counts.append(len(blocks))
    return counts


@pytest.mark.parametrize(("p", "d", "cp"), [(1, 2, 1), (1, 4, 1), (2, 4, 1), (2, 1, 1), (4, 1, 1), (4, 2, 1),
                                           (2, 2, 1), (8, 2, 1), (1, 8, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2),
                                           (4, 2, 2)])
def test_every_decode_rank_gets_exactly_its_heads_in_coalesced_blocks(p: int, d: int, cp: int) -> None:
    """At decode CP 2 (``cp``) each rank gets its heads of the pages it owns only, at their local slots."""
    full = torch.randn(LAYERS, 2, PAGES * PAGE, HEADS, DIM)
    dests, pools, receives = _decode(d, p, cp)
    counts = _send(p, full, dests)
    for dest, pool, receive in zip(dests, pools, receives, strict=True):
        receive.scatter("r", DST_PAGES, START, END)
        torch.testing.assert_close(pool, _expected(full, dest.heads, dest.owner), rtol=0, atol=0)
        assert receive.staging.free_bytes == receive.staging.capacity  # the region went back
    runs = len(token_runs(SRC_PAGES, DST_PAGES, START, END, PAGE))
    assert max(counts) <= 2 * runs  # K and V per run: never one block per token


def test_a_cp_decode_rank_stages_only_its_pages_of_a_prompt_one_ranks_staging_could_not_hold() -> None:
    """A CP 2 decode rank's region holds only its pages of the prompt (owner 1 holds 3 of its 5
    pages: 12 slots, not 19), so staging with room for that but not for every token (3 KiB here)
    still takes a TP 2 writer's KV; before, each rank asked a slot per prompt token, got no region
    and the writer went in place, one block per token. The writes and the scatter land exactly."""
    full = torch.randn(LAYERS, 2, PAGES * PAGE, HEADS, DIM)
    dests, pools, receives = _decode(1, 2, cp=2, staging_bytes=3072)
    assert all(receive.holds("r") for receive in receives)
    assert [s.arena.num_slots for d in dests for s in d.staged] == [3 * PAGE] * 4  # 2 parts on each rank
    assert [staged_slots(d.owner, DST_PAGES, END, PAGE) for d in dests] == [2 * PAGE, 3 * PAGE]
    assert held_pages(PageOwnership(1, 2), DST_PAGES, by_token=True) == [0, None, 1, None, 2]
    counts = _send(2, full, dests)
    for dest, pool, receive in zip(dests, pools, receives, strict=True):
        receive.scatter("r", DST_PAGES, START, END)
        torch.testing.assert_close(pool, _expected(full, dest.heads, dest.owner), rtol=0, atol=0)
    assert max(counts) <= 2 * len(token_runs(SRC_PAGES, DST_PAGES, START, END, PAGE))
    assert staging_problem(dests, HEADS, 2, END, DST_PAGES) is None
    assert "fewer tokens" in (staging_problem(dests, HEADS, 2, END, [1, 3, 5, 7, 9]) or "")  # owner 1 holds all 5


def test_staging_is_offered_only_to_writers_holding_fewer_heads() -> None:
    assert staged_heads(HeadRange(0, 4), 2, HEADS) == [HeadRange(0, 2), HeadRange(2, 2)]
    assert staged_heads(HeadRange(0, 2), 2, HEADS) == []  # the same split: in place
    assert staged_heads(HeadRange(0, 2), 1, HEADS) == []  # the writer holds more: it gathers
    assert staged_heads(HeadRange(0, 4), 0, HEADS) == []  # the writer's TP size is unknown


def test_a_prefill_node_of_another_tp_size_refuses_the_staging() -> None:
    """D staged for TP=4 writers; a TP=2 prefill node would leave the parts unwritten, and D would
    scatter them over its pages: refused before anything is sent."""
    dests, _, _ = _decode(1, 4)
    assert staging_problem(dests, HEADS, 4, END, DST_PAGES) is None
    problem = staging_problem(dests, HEADS, 2, END, DST_PAGES)
    assert problem is not None and "another prefill TP size" in problem
    assert "fewer tokens" in (staging_problem(dests, HEADS, 4, END + 1, DST_PAGES) or "")


def test_a_region_whose_writer_may_still_run_waits_for_its_grace() -> None:
    pool, arena = _pool(HEADS)
    receive = ReceiveStaging(StagingArena(1 << 20), pool, arena, HeadRange(0, HEADS), HEADS)
    assert receive.stage("late", DST_PAGES, END, 2) is not None
    receive.drop("late", free_at=10.0)
    receive.tick(9.0)
    assert receive.staging.free_bytes < receive.staging.capacity
    receive.tick(10.0)
    assert receive.staging.free_bytes == receive.staging.capacity


def test_a_full_arena_stages_nothing_and_the_writer_goes_in_place() -> None:
    pool, arena = _pool(HEADS)
    receive = ReceiveStaging(StagingArena(1024), pool, arena, HeadRange(0, HEADS), HEADS)
    assert receive.stage("big", DST_PAGES, END, 2) is None
    assert receive.parts("big", receive.staging.base, HeadRange(0, HEADS)) == []


def test_the_arena_hands_out_disjoint_ranges_and_merges_what_comes_back() -> None:
    arena = StagingArena(4096)
    a, b, c = (arena.alloc(1000) for _ in range(3))
    assert (a, b, c) == (0, 1024, 2048)
    assert arena.alloc(2048) is None and arena.alloc(2048, timeout=0.01) is None
    arena.free(b, 1000)
    arena.free(a, 1000)
    assert arena.alloc(2048) == 0  # a and b merged
    arena.free(0, 2048)
    arena.free(c, 1000)
    assert arena.free_bytes == arena.capacity and arena.alloc(4096) == 0


@pytest.fixture(scope="module")
def receivers() -> list[tuple[TransferEngineHandle, torch.Tensor, KVArena]]:
    """Two decode ranks (KV heads 0-1 and 2-3), each a real transfer engine with its pool registered."""
    out = []
    for _ in range(2):
        pool, arena = _pool(HEADS // 2)
        engine = TransferEngineHandle("127.0.0.1", TransferProtocol.TCP, "")
        engine.register(pool)
        out.append((engine, pool, arena))
    return out


def _handoff(receivers, full: torch.Tensor, delay_s: float = 0.0, cancel: bool = False
             ) -> tuple[HandoffResult, StagingArena]:
    """A TP=1 prefill rank's real handoff into both decode ranks: its routes gather (on this
    thread, as the engine's); ``cancel``: cancelled once every layer was gathered."""
    pool, src = _pool(HEADS)
    pool.copy_(full)
    staging = StagingArena(1 << 20)
    peers = PeerEngines("127.0.0.1", TransferProtocol.TCP, "", [pool, staging.buffer])
    dests = [RankArena(e.endpoint, a, h) for (e, _, a), h in zip(receivers, _split(2), strict=True)]
    handoff = KVHandoff(with_faults(peers, HandoffFaults(delay_s=delay_s)), plan_routes(HeadRange(0, HEADS),
                        HEAD_BYTES, dests), src, DST_PAGES, START, END, gatherer=Gatherer(staging, pool, src))
    for layer in range(LAYERS):
        handoff.on_layer(layer, SRC_PAGES, END)
    if cancel:
        handoff.cancel("the request was aborted")
    return handoff.result(30), staging


def test_a_real_handoff_gathers_through_staging_and_gives_it_back(receivers) -> None:
    full = torch.randn(LAYERS, 2, PAGES * PAGE, HEADS, DIM)
    result, staging = _handoff(receivers, full)
    assert result.error is None and result.bytes == (END - START) * LAYERS * 2 * HEADS * HEAD_BYTES
    for (_, pool, _), heads in zip(receivers, _split(2), strict=True):
        torch.testing.assert_close(pool, _expected(full, heads), rtol=0, atol=0)
    assert staging.free_bytes == staging.capacity


def test_a_cancelled_handoff_gives_back_the_staging_of_what_it_never_sent(receivers) -> None:
    """Cancelled while its first batch is held (a slow link): the layers gathered but never sent
    give their staging back too."""
    full = torch.randn(LAYERS, 2, PAGES * PAGE, HEADS, DIM)
    result, staging = _handoff(receivers, full, delay_s=0.5, cancel=True)
    assert result.error == "the request was aborted"
    assert staging.free_bytes == staging.capacity


def test_stages_of_other_layer_counts_hold_every_region_at_the_same_offset() -> None:
    """Pipeline stages hold other layer counts (an uneven partition; a packed draft's layers on the
    last stage): sized for the node's most layers, a reservation's region lies at the same offset on
    every stage, so rank 0 names each rank's parts from its own (with that rank's layers)."""
    stages = []
    for layers in (1, 3):
        pool = torch.zeros(layers, 2, PAGES * PAGE, HEADS, DIM)
        arena = KVArena(pool.data_ptr(), layers, PAGES * PAGE, HEADS * HEAD_BYTES, PAGE)
        stages.append(ReceiveStaging(StagingArena(1 << 20), pool, arena, HeadRange(0, HEADS), HEADS, region_layers=3))
    for rid in ("a", "b", "c"):
        regions = [s.stage(rid, DST_PAGES, END, 2) for s in stages]
        assert regions[0].offset == regions[1].offset, rid
    first, last = stages
    assert first.parts("b", 0, HeadRange(0, HEADS), layers=3) == last.parts("b", 0, HeadRange(0, HEADS))
    assert all(p.arena.num_layers == 3 for p in first.parts("b", 0, HeadRange(0, HEADS), layers=3))
