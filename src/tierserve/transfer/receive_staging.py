"""A decode rank's side of coalesced handoffs from prefill ranks that hold fewer KV heads than it
does (P2 -> D1; ``docs/tp.md``, and ``transfer/staging.py``).

At Reserve, knowing the prefill node's TP size, each decode rank sets aside one region of its
staging arena per reservation: one part per sending prefill rank whose heads lie strictly inside the
rank's own, each shaped [layers, 2, tokens, part bytes] with token t at index t. The prefill ranks
write whole slots of theirs there, one block per run; when the request starts, the rank scatters
every part into its pages, then frees the region. Ranks run the same commands in the same order and
the allocation is deterministic, so every rank of a node holds a reservation's region at the same
offset of its own arena: rank 0 names every rank's parts from its own offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.model.parallel import kv_heads_of
from tierserve.transfer.digest import slots_of
from tierserve.transfer.layout import HeadRange, KVArena, StagedPart, held_pages, local_pages, staged_slots
from tierserve.transfer.staging import StagingArena, as_words, slot_view, word_size


def source_ranges(num_kv_heads: int, tp_size: int) -> list[HeadRange]:
    """The KV heads each sending rank of a node of ``tp_size`` ranks holds (replicas once), by the
    model's own split."""
    held = dict.fromkeys(kv_heads_of(rank, tp_size, num_kv_heads) for rank in range(tp_size))
    return [HeadRange(start, count) for start, count in held]


def staged_heads(own: HeadRange, source_tp: int, num_kv_heads: int) -> list[HeadRange]:
    """The source ranks' heads strictly inside ``own``: those ranks write into staging."""
    if source_tp < 1:
        return []
    return [r for r in source_ranges(num_kv_heads, source_tp)
            if own.start <= r.start and r.end <= own.end and r.count < own.count]


def region_slots(owner: PageOwnership, pages: Sequence[int], tokens: int, page_size: int) -> int:
    """The slots of a reservation's region on every rank of a node of ``owner.size`` CP ranks: the
    most any of them needs (``staged_slots``), so every rank allocates the same bytes."""
    return max(staged_slots(PageOwnership(rank, owner.size), pages, tokens, page_size) for rank in range(owner.size))


@dataclass(frozen=True)
class Region:
    """One reservation's staging on a rank: ``nbytes`` at ``offset`` of the arena, for ``tokens``."""

    offset: int
    nbytes: int
    tokens: int
    source_tp: int


def parts(region: Region, base: int, own: HeadRange, num_kv_heads: int, layers: int, head_bytes: int,
          page_size: int) -> list[StagedPart]:
    """The staged parts of the rank holding ``own`` whose arena starts at ``base``."""
    out, at = [], base + region.offset
    for heads in staged_heads(own, region.source_tp, num_kv_heads):
        arena = KVArena(at, layers, region.tokens, heads.count * head_bytes, page_size)
        out.append(StagedPart(heads, arena))
        at += layers * 2 * region.tokens * arena.slot_bytes
    return out


class ReceiveStaging:
    """One decode rank's staging regions, by reservation; called from the engine's commands only.
    Under context parallelism (``owner``) a region holds the pages this rank owns only, packed in
    page-table order (``held_pages`` by token): the writers fill, and ``scatter`` copies, those.
    ``region_layers``: the layers a region is sized for on every rank (0: this rank's arena's), the
    most any rank of the node holds: pipeline stages hold different layer counts (an uneven
    partition; a packed speculative draft's layers on the last stage only), and a reservation's
    region must lie at the same offset on every rank."""

    def __init__(self, staging: StagingArena, pool: torch.Tensor, arena: KVArena, own: HeadRange,
                 num_kv_heads: int, owner: PageOwnership | None = None, region_layers: int = 0) -> None:
        self.staging, self.arena, self.own, self.num_kv_heads = staging, arena, own, num_kv_heads
        self.pool, self.owner = pool, owner or PageOwnership()
        self.region_layers = region_layers or arena.num_layers
        self.regions: dict[str, Region] = {}
        self._quarantine: list[tuple[float, Region]] = []  # (free at, region)

    @property
    def used_bytes(self) -> int:
        """Bytes held by reservations, quarantined ones included."""
        return self.staging.capacity - self.staging.free_bytes

    @property
    def head_bytes(self) -> int:
        return self.arena.slot_bytes // self.own.count

    def stage(self, request_id: str, pages: Sequence[int], tokens: int, source_tp: int) -> Region | None:
        """Sets a region aside for the first ``tokens`` tokens of the logical page table ``pages``
        when the source's ranks hold fewer heads than this rank (else, or without room, None: they
        write in place). Under CP every rank sizes it for the owner holding the most of those pages
        (``region_slots``), so every rank's region lies at the same offset."""
        if not staged_heads(self.own, source_tp, self.num_kv_heads):
            return None
        tokens = region_slots(self.owner, pages, tokens, self.arena.page_size)
        nbytes = self.region_layers * 2 * tokens * self.arena.slot_bytes
        offset = self.staging.alloc(nbytes)
        if offset is None:
            return None
        self.regions[request_id] = region = Region(offset, nbytes, tokens, source_tp)
        return region

    def holds(self, request_id: str) -> bool:
        """The reservation has a region here (its writers stage; ``scatter`` has work)."""
        return request_id in self.regions

    def parts(self, request_id: str, base: int, own: HeadRange, layers: int | None = None) -> list[StagedPart]:
        """The parts of ``request_id``'s region on the rank holding ``own`` of ``layers`` layers
        (default: as many as this rank) at arena ``base``."""
        region = self.regions.get(request_id)
        if region is None:
            return []
        return parts(region, base, own, self.num_kv_heads, layers or self.arena.num_layers, self.head_bytes,
                     self.arena.page_size)

    def scatter(self, request_id: str, pages: list[int], start: int, end: int) -> None:
        """Copies tokens ``[start, end)`` of every part into their slots through the logical page
        table ``pages`` (those of the pages this rank owns), then frees the region."""
        region = self.regions.pop(request_id, None)
        if region is None:
            return
        slots, _ = slots_of(local_pages(self.owner, pages), start, end, self.arena.page_size)
        staged, _ = slots_of(held_pages(self.owner, pages, by_token=True), start, end, self.arena.page_size)
        index = torch.from_numpy(slots).to(self.pool.device)
        rows = torch.from_numpy(staged).to(self.pool.device)
        for part in parts(region, 0, self.own, self.num_kv_heads, self.arena.num_layers, self.head_bytes,
                          self.arena.page_size):
            self._scatter_part(part, index, rows)
        self.staging.free(region.offset, region.nbytes)

    def drop(self, request_id: str, free_at: float | None) -> None:
        """The reservation ended without running: frees its region now (``free_at`` None: no
        writer can still land in it) or once ``tick`` passes ``free_at``."""
        region = self.regions.pop(request_id, None)
        if region is None:
            return
        if free_at is None:
            self.staging.free(region.offset, region.nbytes)
        else:
            self._quarantine.append((free_at, region))

    def tick(self, now: float) -> None:
        """Frees quarantined regions whose time came (``now``: rank 0's clock, as every rank ticks)."""
        due = [q for q in self._quarantine if q[0] <= now]
        for entry in due:
            self._quarantine.remove(entry)
            self.staging.free(entry[1].offset, entry[1].nbytes)

    def _scatter_part(self, part: StagedPart, index: torch.Tensor, rows: torch.Tensor) -> None:
        a = part.arena  # its base is the offset into this rank's staging arena
        column = (part.heads.start - self.own.start) * self.head_bytes
        word = word_size(self.arena.slot_bytes, column, a.slot_bytes, a.base)
        staged = as_words(self.staging.view(a.base, a.num_layers * 2 * a.num_slots * a.slot_bytes), word)
        tokens = staged.view(a.num_layers, 2, a.num_slots, a.slot_bytes // word)[:, :, rows]
        slots = slot_view(self.pool, self.arena, word)
        slots[:, :, index, column // word: (column + a.slot_bytes) // word] = tokens
