"""The context-parallel part of a step (``docs/cp.md``): what ``ModelRunner`` holds only when a
node's ranks share the KV pages, one page per owner rank. For each step it chooses how attention
reads the cached prefix, merged where it lies (``merge.py``) or gathered per layer (``gather.py``),
and sets up the attention batch and the KV store the model runs on accordingly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.engine.config import CPAttention
from tierserve.engine.cp.gather import GatherClock, LayerGather, plan_rows, renumber
from tierserve.engine.cp.merge import MergeClock, MergedAttention, own_writes, short_step
from tierserve.engine.cp.partial import BatchedKeys, SeqKeys, SplitKeys
from tierserve.engine.cp.split import SPLIT_MIN_TOKENS, SplitAttention, SplitClock, SplitPlan, SplitSeq
from tierserve.engine.scheduler import Scheduled, pages_for
from tierserve.model.attention import AttentionBatch, KVStore


@dataclass(frozen=True)
class CPStep:
    """What the model runs on for one step: its KV store, and under a split step the rows this rank
    computes (``split``; None: every row, the replicated step)."""

    kv: KVStore
    split: SplitPlan | None = None


class CPRunner:
    """This rank's side of every step under context parallelism (``own``: the pages it owns, of
    ``own.size`` ranks). Contract: every rank calls ``kv`` for the same batch, in the same order,
    and runs the model on what it returns (the collectives go over ``merge_group`` for merged
    attention, ``group`` for gathers: the CP ranks holding this rank's heads of its layers, None
    the default group). ``attention`` says whether steps may merge at all."""

    def __init__(self, own: PageOwnership, pool: DeviceKVPool, device: torch.device,
                 merge_group: dist.ProcessGroup | None = None, attention: CPAttention = CPAttention.MERGE,
                 group: dist.ProcessGroup | None = None, attended: int = 0) -> None:
        """``attended``: the first of ``pool``'s layers the model attends over (an EAGLE head's)."""
        self.own, self.pool, self.device, self.attended = own, pool, device, attended
        self.page_size = pool.page_size
        self.merge_group = merge_group  # the merged attention's group (None: the default group)
        self.group = group  # the gathers' group (None: the default group)
        self.attention = attention
        self.gather_clock = GatherClock()  # the exposed share of the per-layer gathers
        self.merge_clock = MergeClock()  # short steps merged instead of gathered
        self.split_clock = SplitClock()  # long steps whose tokens the ranks divided

    def step(self, ordered: list[Scheduled], attn: AttentionBatch, every_row: bool) -> CPStep:
        """What the model runs on for ``ordered`` (extends, then decodes): ``step_of`` its sequences."""
        return self.step_of(self._seq_keys(ordered), attn, every_row)

    def step_of(self, seqs: list[SeqKeys], attn: AttentionBatch, every_row: bool = False) -> CPStep:
        """What the model runs on for the step of ``seqs`` (extends, then decodes, in ``attn``'s flat
        order): a long step (at least ``SPLIT_MIN_TOKENS`` new tokens in its extends, no need of
        ``every_row``'s hidden states, as prompt logprobs have) splits its extends' tokens between the
        ranks, every rank computing the decodes (``split.py``); any other step is replicated, its
        attention set up by ``kv_of``. ``--cp-attention gather`` never splits."""
        extends = [s for s in seqs if not (s.length == 1 and s.first_position > 0)]
        if every_row or self.attention is CPAttention.GATHER or sum(s.length for s in extends) < SPLIT_MIN_TOKENS:
            return CPStep(self.kv_of(seqs, attn))
        gather = self._sharded(prefix_pages(seqs, self.page_size), attn)  # the prefix's pages, per layer
        split = [SplitSeq(s.start, s.length, s.first_position,
                          gather.plan.rows[self._tensor(s.pages[: pages_for(s.first_position, self.page_size)])]
                          if s.first_position else None) for s in extends]
        plan = SplitPlan.build(split, self.own.rank, self.own.size, self.device, len(seqs) - len(extends))
        attn.partial = SplitAttention(plan, gather, attn, self.merge_group, self.split_clock)
        self.split_clock.steps += 1
        self.split_clock.decodes += plan.decodes
        return CPStep(gather, plan)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def over(self, pool: DeviceKVPool, attention: CPAttention | None = None, attended: int = 0) -> CPRunner:
        """The same ranks and groups over another KV store with the same page ids and owners (a
        speculative draft's: a sidecar pool, or a packed pool's draft layers as a pool of their own,
        ``OffsetKV``; docs/speculative.md, STANDALONE and EAGLE at CP), the same ``attention`` unless
        given, the model attending over its layers from ``attended`` on (above 0 with
        ``CPAttention.GATHER`` only: the merge counts layers from 0). Its clocks are its own, so the
        target's metrics count the target's passes only."""
        return CPRunner(self.own, pool, self.device, self.merge_group, attention or self.attention, self.group,
                        attended)

    def kv(self, ordered: list[Scheduled], attn: AttentionBatch) -> KVStore:
        """What the model reads and writes for ``ordered`` (``attn`` is set up to match): ``kv_of``
        its sequences."""
        return self.kv_of(self._seq_keys(ordered), attn)

    def kv_of(self, seqs: list[SeqKeys], attn: AttentionBatch) -> KVStore:
        """What the model reads and writes for the step of ``seqs`` (in ``attn``'s flat order; a
        sequence's ``pages`` hold its tokens up to the step's end). Every layer of a short step
        merges each rank's attention over its own pages; a longer step with a cached prefix merges
        layer 0 and gathers the prefix pages of layers 1.. from their owners."""
        short = short_step([s.length for s in seqs], self.page_size)
        prefix = prefix_pages(seqs, self.page_size)
        if self.attention is CPAttention.GATHER or not (short or prefix):
            return self._sharded(prefix, attn)  # asked to gather, or nothing cached to merge or gather
        reader = (BatchedKeys if short else SplitKeys)(self.own, seqs, self.page_size, self.device)
        layers = self.pool.geometry.num_layers if short else 1
        writes = own_writes(self.own, attn.out_slots, self.page_size)
        attn.partial = MergedAttention(self.own, self.pool, reader, writes, attn.hooks, layers, self.merge_group,
                                       self.merge_clock)
        if short:
            self.merge_clock.short_steps += 1
            return self.pool
        self.merge_clock.first_layer_steps += 1
        return self._sharded(prefix, attn, first=1)

    def stats(self) -> dict[str, float]:
        """This rank's seconds spent waiting for per-layer gathers, its merged and its split steps."""
        return self.gather_clock.stats() | self.merge_clock.stats() | self.split_clock.stats()

    def _seq_keys(self, ordered: list[Scheduled]) -> list[SeqKeys]:
        seqs, start = [], 0
        for s in ordered:
            r = s.request
            pages = r.pages[: pages_for(r.num_computed + s.num_tokens, self.page_size)]
            seqs.append(SeqKeys(start, s.num_tokens, r.num_computed, pages))
            start += s.num_tokens
        return seqs

    def _sharded(self, prefix: set[int], attn: AttentionBatch, first: int = 0) -> LayerGather:
        """Renumbers ``attn`` onto a step buffer and gathers its ``prefix`` pages from their owners,
        layer ``first`` on (``engine/cp/gather.py``)."""
        touched = set((attn.out_slots // self.page_size).tolist())
        plan = plan_rows(self.own, prefix, touched,
                         self.pool.num_pages * self.own.size, self.device)
        slots = renumber(attn, plan.rows)
        attn.hooks = LayerGather(self.own, self.pool, plan, slots, attn, attn.hooks, self.group,
                                 clock=self.gather_clock, first=max(first, self.attended), attended=self.attended)
        return attn.hooks


def context_parallel(own: PageOwnership, pool: DeviceKVPool, device: torch.device,
                     merge_group: dist.ProcessGroup | None, attention: CPAttention,
                     group: dist.ProcessGroup | None = None) -> CPRunner | None:
    """The ``CPRunner`` of a rank that shares its node's pages (``group``: its CP group, for the
    gathers); None without context parallelism."""
    return CPRunner(own, pool, device, merge_group, attention, group) if own.size > 1 else None


def prefix_pages(seqs: list[SeqKeys], page_size: int) -> set[int]:
    """The pages holding tokens computed before the step of ``seqs``: what attention reads from their owners."""
    return {p for s in seqs for p in s.pages[: pages_for(s.first_position, page_size)]}
