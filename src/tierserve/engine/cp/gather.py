"""Context parallelism's step: gather the cached prefix's pages from their owners, one layer at a
time, into two alternating buffers (``docs/cp.md``).

Every rank computes every new token (or, in a split step, its share: ``split.py``); a page's KV is stored by its
owner only (``cache/sharded/cp_pages.py``). Attention then reads a temporary *step buffer* instead of the
pool: rows ``[o * width, (o + 1) * width)`` hold owner ``o``'s prefix pages (gathered), the rows
after them the step's pages that hold no earlier token (nothing to gather). The attention batch's
slots and page tables are renumbered to buffer rows, so attention itself is unchanged: it writes
the step's new K/V into the buffer and reads the buffer; ``after_kv_written`` copies the new K/V
of the pages this rank owns into its pool.

Layer l's gather starts while layer l-1 computes (``before_attention(l - 1)``) into the buffer
layer l-2 used; attention of layer l waits for it. Layer 0, which has no layer before it to hide
a gather behind, merges instead (``engine/cp/merge.py``; ``first=1``), as do short steps. Only
tokens before each sequence's ``num_computed`` are read from gathered rows, so an owner writing
layer l's new tokens while its pages are in flight cannot change what is read (and sends are
copied out when the gather starts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierserve.cache.device_pool import DeviceKVPool
from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.engine.cp.merge import own_writes
from tierserve.model.attention import AttentionBatch, LayerHooks

BUFFERS = 2  # double buffering: gathering layer l+1 while layer l computes


@dataclass(frozen=True)
class RowPlan:
    """Where a step's pages sit in the step buffer. ``senders[o]``: owner o's prefix pages in row
    order; ``width``: rows per owner; ``rows``: logical page -> row (dense over the logical ids)."""

    senders: list[list[int]]
    width: int
    rows: torch.Tensor
    num_rows: int


@dataclass
class GatherClock:
    """How much of the per-layer gathers attention waited for (the exposed part), summed over steps:
    ``waited[k]`` the seconds ``before_attention`` blocked on the gather, ``spans[k]`` the seconds from
    each gather's start to the end of that wait, for k = ``"first"`` (layer 0, started just before
    the forward, so nothing overlaps it but the embedding) and ``"later"`` (layers 1.., overlapped
    with the previous layer's compute). A gather done before its wait adds ~0 to ``waited``; one
    still running ends during the wait, so ``waited / spans`` is the share left exposed."""

    waited: dict[str, float] = field(default_factory=lambda: {"first": 0.0, "later": 0.0})
    spans: dict[str, float] = field(default_factory=lambda: {"first": 0.0, "later": 0.0})

    def record(self, layer_id: int, started: float, wait_began: float, wait_ended: float) -> None:
        kind = "first" if layer_id == 0 else "later"
        self.waited[kind] += wait_ended - wait_began
        self.spans[kind] += wait_ended - started

    def stats(self) -> dict[str, float]:
        """``cp_gather_{first,later}_{wait,span}_seconds_total``: counters for ``/metrics``."""
        return {f"cp_gather_{k}_{name}_seconds_total": v for name, d in (("wait", self.waited), ("span", self.spans))
                for k, v in d.items()}


def plan_rows(own: PageOwnership, prefix: set[int], touched: set[int], num_pages: int,
              device: torch.device) -> RowPlan:
    """The rows of the ``prefix`` pages (gathered, by owner) then of the other ``touched`` pages.
    Deterministic in its inputs: every rank computes the same plan for the same batch."""
    senders = [sorted(p for p in prefix if own.owner(p) == o) for o in range(own.size)]
    width = max(len(s) for s in senders)
    rows = torch.zeros(num_pages, dtype=torch.int64)
    for o, pages in enumerate(senders):
        rows[pages] = torch.arange(len(pages), dtype=torch.int64) + o * width
    fresh = sorted(touched - prefix)
    rows[fresh] = torch.arange(len(fresh), dtype=torch.int64) + own.size * width
    return RowPlan(senders, width, rows.to(device), own.size * width + len(fresh))


def renumber(batch: AttentionBatch, rows: torch.Tensor) -> torch.Tensor:
    """Points ``batch``'s slots and page tables at step-buffer rows; returns the original slots."""
    ps, slots = batch.page_size, batch.out_slots
    batch.out_slots = rows[slots // ps] * ps + slots % ps
    for span in batch.extends:
        if span.kv_pages is not None:
            span.kv_pages = rows[span.kv_pages]
    if batch.decode_pages is not None:
        batch.decode_pages = rows[batch.decode_pages]  # padding (page 0) lands on some row, masked
    return slots


class LayerGather:
    """One step's KV store (the step buffer) and layer hooks under context parallelism.

    Contract: built before the forward, which then calls ``layer(l)``, ``before_attention(l)`` and
    ``after_kv_written(l)`` for l = 0, 1, ... in order; every rank of the group builds it for the
    same batch and runs the same collectives (none when no page needs gathering)."""

    def __init__(self, own: PageOwnership, pool: DeviceKVPool, plan: RowPlan, slots: torch.Tensor,
                 batch: AttentionBatch, inner: LayerHooks | None = None, group: dist.ProcessGroup | None = None,
                 clock: GatherClock | None = None, first: int = 0, attended: int = 0) -> None:
        """``first``: the first gathered layer (those before it merge, ``engine/cp/merge.py``);
        ``attended``: the forward's first attending layer (an EAGLE head's, after its feature plane's
        layers), where a gather that nothing earlier starts is started here."""
        self.own, self.pool, self.plan, self.inner, self.group = own, pool, plan, inner, group
        self.first = first
        self.clock = clock
        self.started: dict[int, float] = {}  # layer -> when its gather was started
        self.page_size = pool.page_size
        g, device = pool.geometry, pool.buffer.device
        shape = (plan.num_rows * g.page_size, g.num_kv_heads, g.head_dim)
        # zeros, not empty: a decode reads its whole last page and masks what is past its length, and
        # masking cannot hide a NaN that uninitialised memory may hold (NaN + -inf is NaN)
        self.buffers = [(torch.zeros(shape, dtype=g.dtype, device=device),
                         torch.zeros(shape, dtype=g.dtype, device=device)) for _ in range(BUFFERS)]
        mine = plan.senders[own.rank]
        local = [own.local(p) for p in mine] + [0] * (plan.width - len(mine))  # padding rows: never read
        self.send_pages = torch.tensor(local, dtype=torch.int64, device=device)
        self._own_writes(slots, batch.out_slots)
        self.pending: dict[int, list] = {}
        self.num_layers = g.num_layers
        if first == attended:
            self._start(first)

    def _own_writes(self, slots: torch.Tensor, buffer_slots: torch.Tensor) -> None:
        """The pool slots of the new tokens whose pages this rank owns, and their buffer slots."""
        rows, self.pool_slots = own_writes(self.own, slots, self.page_size)
        self.buffer_slots = buffer_slots[rows]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers[layer_id % BUFFERS]

    def before_attention(self, layer_id: int) -> None:
        """Waits for layer ``layer_id``'s gather (which waited for its restore, ``_start``; a merged
        layer waits for its restore only), then starts the next layer's."""
        if layer_id < self.first and self.inner is not None:
            self.inner.before_attention(layer_id)
        handles = self.pending.pop(layer_id, [])
        wait_began = time.perf_counter()
        for handle in handles:
            handle.wait()
        if handles and self.clock is not None:  # two clock reads per layer: nothing next to the gather itself
            self.clock.record(layer_id, self.started.pop(layer_id), wait_began, time.perf_counter())
        if layer_id + 1 < self.num_layers:
            self._start(layer_id + 1)  # into the buffer layer l-1 used: its attention is done

    def after_kv_written(self, layer_id: int) -> None:
        """The owner stores the step's new K/V of its pages: the buffer now holds them."""
        for pool, buffer in zip(self.pool.layer(layer_id), self.layer(layer_id), strict=True):
            rows = buffer.view(buffer.shape[0], -1).index_select(0, self.buffer_slots)
            pool.view(pool.shape[0], -1).index_copy_(0, self.pool_slots, rows)
        if self.inner is not None:
            self.inner.after_kv_written(layer_id)

    def _start(self, layer_id: int) -> None:
        """Starts gathering layer ``layer_id``'s prefix pages from their owners (asynchronous), once
        the inner hooks let that layer's attention go: a prefix page restored from L2 by its owner
        must have the layer in its pool before the owner sends it (HiCache under CP). So the inner
        ``before_attention(l)`` runs at the start of layer l's gather, while layer l-1 computes."""
        if self.inner is not None:
            self.inner.before_attention(layer_id)
        if self.plan.width == 0:
            return
        self.started[layer_id] = time.perf_counter()
        handles = []
        for pool, buffer in zip(self.pool.layer(layer_id), self.layer(layer_id), strict=True):
            send = pool.view(-1, self.page_size * pool[0].numel()).index_select(0, self.send_pages)
            rows = buffer.view(self.plan.num_rows, -1)[: self.own.size * self.plan.width]
            handles.append(dist.all_gather(list(rows.chunk(self.own.size)), send, group=self.group, async_op=True))
        self.pending[layer_id] = handles
