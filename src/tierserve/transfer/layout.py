"""Where a token's K or V lives in a KV arena (under context parallelism: in its owner's), which
heads of it go to which peer rank, and the coalesced block list of a handoff (no Mooncake import:
the nodes and tests use it without loading the transfer engine)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tierserve.cache.sharded.cp_pages import PageOwnership

Block = tuple[int, int, int]  # (source address, destination address, bytes)
Run = tuple[int, int, int]  # (source slot, destination slot, tokens)


@dataclass(frozen=True)
class KVArena:
    """An arena [num_layers, 2 (K, V), num_slots, kv_heads, head_dim] at ``base`` (the device
    pool's layout); ``slot_bytes`` is one token's K (or V) in one layer: every head the arena's
    rank holds, side by side, so a head sub-range of a slot is one contiguous span."""

    base: int
    num_layers: int
    num_slots: int
    slot_bytes: int
    page_size: int

    def address(self, layer: int, kv: int, slot: int) -> int:
        return self.base + ((layer * 2 + kv) * self.num_slots + slot) * self.slot_bytes

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size


@dataclass(frozen=True)
class HeadRange:
    """KV heads ``[start, start + count)`` of the model."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class LayerRange:
    """The model's layers ``[start, start + count)``: what a pipeline stage's arena holds."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


EVERY_LAYER = range(1 << 31)  # a route's source layers when neither side has pipeline stages
EVERY_PAGE = PageOwnership()  # a destination rank without context parallelism holds every page


@dataclass(frozen=True)
class StagedPart:
    """Staging a destination rank offers for the heads ``heads`` (fewer than it holds): an arena
    whose slot ``t`` is token ``t`` of the prompt (``transfer/staging.py``)."""

    heads: HeadRange
    arena: KVArena


@dataclass(frozen=True)
class RankArena:
    """One rank of a destination node: its transfer engine, its arena, the model's KV heads it
    holds, and the staging it offers this request (none: every source writes in place). Its
    arena's layer i (and its staging's) is the model's layer ``first_layer + i``: a pipeline
    stage holds only its layers. ``owner``: the logical pages its arena holds (a decode node with
    context parallelism: only those it owns, each at its local slot; ``docs/cp.md``). ``draft``: the
    rank's sidecar speculative draft pool, as a rank holding the draft's KV heads ``draft.heads``
    (None: it holds none; ``docs/speculative.md``, PD)."""

    endpoint: str
    arena: KVArena
    heads: HeadRange
    staged: tuple[StagedPart, ...] = ()
    staging_base: int = 0  # where the rank's staging arena starts (0: it has none)
    first_layer: int = 0
    owner: PageOwnership = EVERY_PAGE
    draft: RankArena | None = None

    @property
    def layers(self) -> LayerRange:
        return LayerRange(self.first_layer, self.arena.num_layers)


@dataclass(frozen=True)
class Route:
    """Part of every token slot that goes to one destination rank: ``nbytes`` from ``src_offset``
    into a source slot, written at ``dst_offset`` into a slot of ``dst`` at ``target``; only the
    source's (arena) layers ``layers``, source layer l into destination layer ``l + layer_shift``
    (pipeline stages on either side hold different layer ranges); only the pages ``owner`` says
    the destination rank holds (a CP decode rank), each into its local slot."""

    target: str
    dst: KVArena
    src_offset: int
    dst_offset: int
    nbytes: int
    by_token: bool = False  # ``dst`` is staging: its slot t is token t, not the page table's slot
    layers: range = EVERY_LAYER
    layer_shift: int = 0
    owner: PageOwnership = EVERY_PAGE

    def dst_layer(self, layer: int) -> int:
        return layer + self.layer_shift


def plan_routes(held: HeadRange, head_bytes: int, dests: list[RankArena], layers: LayerRange | None = None
                ) -> list[Route]:
    """Where the heads ``held`` of the model's ``layers`` (None: every layer, on both sides) by a
    source rank go: one route per destination rank holding some of them (several when the
    destination splits them finer, one part of a slot when it holds more: into the staging that
    rank offers for exactly these heads, if any), for the layers both ranks hold."""
    routes = []
    for dest in dests:
        shared = _shared_layers(layers, dest)
        if shared is None:
            continue
        lo, hi = max(held.start, dest.heads.start), min(held.end, dest.heads.end)
        staged = next((s for s in dest.staged if s.heads == held), None)
        if staged is not None:
            routes.append(Route(dest.endpoint, staged.arena, 0, 0, held.count * head_bytes, True, *shared,
                                dest.owner))
        elif lo < hi:
            routes.append(Route(dest.endpoint, dest.arena, (lo - held.start) * head_bytes,
                                (lo - dest.heads.start) * head_bytes, (hi - lo) * head_bytes, False, *shared,
                                dest.owner))
    return routes


def _shared_layers(layers: LayerRange | None, dest: RankArena) -> tuple[range, int] | None:
    """The source's arena layers that ``dest`` holds too, and the shift into its arena's; None: none.
    A source without stages (``layers`` None) holds every layer from 0."""
    layers = layers or LayerRange(0, len(EVERY_LAYER))
    lo, hi = max(layers.start, dest.first_layer), min(layers.end, dest.layers.end)
    if lo >= hi:
        return None
    return range(lo - layers.start, hi - layers.start), layers.start - dest.first_layer


def token_runs(src_pages: Sequence[int | None], dst_pages: Sequence[int | None], start: int, end: int,
               page_size: int) -> list[Run]:
    """Tokens ``[start, end)`` as (source slot, destination slot, tokens) runs that are
    consecutive on both sides: pages allocated together usually are, so a long prompt is a few
    runs rather than one entry per page. A source page None is not in this source's pool (under
    context parallelism another rank owns it and sends it), a destination page None not in this
    destination rank's (a CP decode node: another rank holds it): their tokens are left out."""
    runs: list[Run] = []
    token = start
    while token < end:
        page, offset = divmod(token, page_size)
        n = min(page_size - offset, end - token)
        src, dst = src_pages[page], dst_pages[page]
        if src is not None and dst is not None:
            _extend(runs, src * page_size + offset, dst * page_size + offset, n)
        token += n
    return runs


def local_pages(owner: PageOwnership | None, pages: list[int]) -> list[int] | list[int | None]:
    """Logical ``pages`` as pages of this rank's pool, for ``token_runs``: under context parallelism
    (``owner`` of size above 1) a page's local slot where this rank owns it, None where another CP
    rank does (that rank sends it); otherwise the pages themselves."""
    if owner is None or owner.size == 1:
        return pages
    return [owner.local(p) if owner.owns(p) else None for p in pages]


def held_pages(owner: PageOwnership, logical: Sequence[int], by_token: bool = False) -> list[int | None]:
    """The destination side of ``token_runs`` for a rank holding ``owner``'s logical pages: page i
    of the table ``logical`` as the rank's local page (``page // N``), or None where another CP
    rank of the destination holds it. ``by_token``: as a page of the rank's staging region, whose
    slot t is token t without CP; under CP the region packs the rank's own pages in table order
    (its k-th page of the table is the region's page k: ``staged_slots``)."""
    if owner.size == 1:
        return list(range(len(logical))) if by_token else list(logical)
    if not by_token:
        return [owner.local(p) if owner.owns(p) else None for p in logical]
    ranks = itertools.accumulate(owner.owns(p) for p in logical)  # 1 + the page's rank among the owned ones
    return [k - 1 if owner.owns(p) else None for p, k in zip(logical, ranks, strict=True)]


def staged_slots(owner: PageOwnership, logical: Sequence[int], tokens: int, page_size: int) -> int:
    """The slots a staging region of the rank holding ``owner``'s pages needs for the first
    ``tokens`` tokens of the page table ``logical`` (``held_pages`` by token): every token without
    CP; under CP the whole pages it owns among theirs (about 1/N of them: a long prompt that fits
    the node's pages needs only its share of one rank's staging)."""
    if owner.size == 1:
        return tokens
    return page_size * sum(owner.owns(p) for p in logical[: -(-tokens // page_size)])


def _extend(runs: list[Run], s: int, d: int, n: int) -> None:
    """Appends the run (s, d, n), merged into the last one when it continues it on both sides."""
    if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
        runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
    else:
        runs.append((s, d, n))


def layer_blocks(src: KVArena, dst: KVArena, runs: list[Run], layer: int, dst_layer: int | None = None
                 ) -> list[Block]:
    """One block per run for K and one for V of ``layer`` into ``dst_layer`` (default: the same;
    whole slots on both sides)."""
    into = layer if dst_layer is None else dst_layer
    return [
        (src.address(layer, kv, s), dst.address(into, kv, d), n * src.slot_bytes)
        for kv in (0, 1)
        for s, d, n in runs
    ]


def route_blocks(src: KVArena, route: Route, runs: list[Run], layer: int) -> list[Block]:
    """``layer``'s blocks along ``route``: coalesced runs when it moves whole slots (the same TP
    size on both sides), else one block per token, since a head sub-range of consecutive slots is
    not contiguous in the arena's layout."""
    into = route.dst_layer(layer)
    if route.nbytes == src.slot_bytes == route.dst.slot_bytes:
        return layer_blocks(src, route.dst, runs, layer, into)
    return [
        (src.address(layer, kv, s + i) + route.src_offset, route.dst.address(into, kv, d + i) + route.dst_offset,
         route.nbytes)
        for kv in (0, 1)
        for s, d, n in runs
        for i in range(n)
    ]
