"""Context parallelism's split step: the ranks divide a long step's new tokens between them
(``docs/cp.md``, "How the ranks split the compute").

Each sequence's new tokens are cut into ``2N`` zigzag chunks and rank r computes chunks r and
``2N-1-r`` (``zigzag``): a query at offset i of the step attends over ``prefix + i`` keys, so the
pairs cost every rank the same, and rank 0 (the sampling rank under CP) holds every sequence's last
token, the only hidden row sampling needs. A rank runs the embedding, projections, MLP and norms on
its own rows only; at attention it exchanges its rows' new K/V with the other ranks (one all-gather
per layer, ``SplitAttention._start_exchange``), so the owner of every page stores the step's KV of that
page and every rank attends its queries over the cached prefix (gathered per layer from its owners,
``engine/cp/gather.py``) plus every new key up to its position. On the CPU the exchange runs while the
rank attends over the prefix and its own keys; only the part over the step's earlier keys waits for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierserve.engine.cp.gather import LayerGather
from tierserve.model.attention import AttentionBatch, decode_attention, gather_pages, split_extend
from tierserve.model.partial_attention import causal_cpu, combine, unmasked_cpu

SPLIT_MIN_TOKENS = 256  # a step with fewer new tokens stays replicated: docs/cp.md has the measurement


@dataclass(frozen=True)
class SplitSeq:
    """One sequence of a split step: its new tokens' rows in the step's flat batch (``start``,
    ``length``), the tokens before the step (``prefix``) and the step-buffer rows of their pages."""

    start: int
    length: int
    prefix: int
    prefix_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class Piece:
    """A run of this rank's queries in one sequence: its first row among this rank's rows
    (``local``), its offset among the sequence's new tokens (``offset``), its length."""

    seq: int
    local: int
    offset: int
    length: int


@dataclass
class SplitClock:
    """Steps that split their tokens between the ranks, the decodes they computed on every rank
    (steps mixing a long chunk with decodes), and the seconds attention waited for their K/V exchanges
    (what the attention started before the wait did not hide)."""

    steps: int = 0
    decodes: int = 0
    seconds: float = 0.0

    def stats(self) -> dict[str, float]:
        return {"cp_split_steps_total": float(self.steps), "cp_split_decodes_total": float(self.decodes),
                "cp_split_exchange_seconds_total": self.seconds}


def zigzag(length: int, size: int) -> list[list[tuple[int, int]]]:
    """Per rank, the ``[begin, end)`` offsets of its two chunks of a sequence's ``length`` new tokens
    (``2 * size`` chunks; rank r takes r and ``2 * size - 1 - r``; empty chunks where there are fewer
    tokens than chunks). Rank 0 always holds the last token."""
    bounds = [c * length // (2 * size) for c in range(2 * size + 1)]
    return [[(bounds[r], bounds[r + 1]), (bounds[2 * size - 1 - r], bounds[2 * size - r])] for r in range(size)]


@dataclass(frozen=True)
class SplitPlan:
    """Which of the extends' flat rows each of ``size`` ranks computes (``rows[r]``, ascending), the
    ``decodes`` rows after them that every rank computes, this rank's ``pieces`` and ``mine`` (its
    split rows, then the decodes', as a tensor), and ``perm``: the flat row of each entry of the ranks'
    split rows concatenated in rank order (where an exchange puts what it gathered)."""

    rank: int
    seqs: list[SplitSeq]
    rows: list[list[int]]
    decodes: int
    pieces: list[Piece]
    mine: torch.Tensor
    perm: torch.Tensor

    @classmethod
    def build(cls, seqs: list[SplitSeq], rank: int, size: int, device: torch.device, decodes: int = 0) -> SplitPlan:
        """The same plan on every rank for the same ``seqs`` and ``decodes`` (one token each, after the
        extends in the flat batch); only ``pieces`` and ``mine`` differ."""
        rows: list[list[int]] = [[] for _ in range(size)]
        pieces: list[Piece] = []
        for i, s in enumerate(seqs):
            for r, chunks in enumerate(zigzag(s.length, size)):
                for begin, end in chunks:
                    if r == rank and end > begin:
                        pieces.append(Piece(i, len(rows[r]), begin, end - begin))
                    rows[r] += range(s.start + begin, s.start + end)
        end = seqs[-1].start + seqs[-1].length if seqs else 0
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        mine = as_tensor([*rows[rank], *range(end, end + decodes)])
        return cls(rank, seqs, rows, decodes, pieces, mine, as_tensor([x for r in rows for x in r]))

    def local_rows(self, flat_rows: list[int]) -> list[int]:
        """This rank's row of each flat row (the sampler's: every sequence's last token is rank 0's)."""
        index = {row: i for i, row in enumerate(self.mine.tolist())}
        missing = [row for row in flat_rows if row not in index]
        if missing:
            raise ValueError(f"rank {self.rank} does not compute flat rows {missing}")
        return [index[row] for row in flat_rows]


class SplitAttention:
    """``PartialAttention`` (``model/attention.py``) of every layer of a split step.

    Contract: every rank of ``group`` builds it for the same batch (same ``plan`` up to its rank) over
    the step's ``LayerGather`` ``store`` and ``batch`` (renumbered onto the step buffer: its
    ``out_slots`` and decode pages); the forward calls ``attend`` for each layer in order with this
    rank's rows only (``plan.mine``); each call runs one all-gather whose shape every rank agrees on."""

    def __init__(self, plan: SplitPlan, store: LayerGather, batch: AttentionBatch, group: dist.ProcessGroup | None,
                 clock: SplitClock | None = None) -> None:
        self.plan, self.store, self.batch, self.group, self.clock = plan, store, batch, group, clock
        self.width = max(1, *(len(r) for r in plan.rows))  # every rank sends this many rows (padded)

    def covers(self, layer_id: int) -> bool:
        return True

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [n, heads, dim], k/v [n, kv_heads, dim] of this rank's rows -> [n, heads * dim]. On the CPU the
        exchange runs while this rank attends its pieces over the prefix and over their own keys; only
        the part over the step's earlier keys waits for it (``docs/cp.md``, the exchange's overlap)."""
        split = len(self.plan.rows[self.plan.rank])  # this rank's extend rows; the decodes' after them
        exchange = self._start_exchange(torch.cat([k[:split], v[:split]], dim=1))
        buffers = self.store.layer(layer_id)
        early = self._local_parts(q, k, v, buffers, scale) if q.device.type == "cpu" else None
        kv = torch.cat([self._finish_exchange(*exchange), torch.cat([k[split:], v[split:]], 1)])
        k_all, v_all = kv[:, : k.shape[1]], kv[:, k.shape[1]:]
        for buffer, new in zip(buffers, (k_all, v_all), strict=True):
            buffer.view(buffer.shape[0], -1).index_copy_(0, self.batch.out_slots, new.reshape(new.shape[0], -1))
        self.store.after_kv_written(layer_id)  # the owners store their pages' new K/V
        out = torch.empty_like(q)
        for i, s in enumerate(self.plan.seqs):
            pieces = [p for p in self.plan.pieces if p.seq == i]
            if pieces and early is not None:
                self._finish_seq(s, pieces, q, out, (k_all, v_all), early, scale)
            elif pieces:
                self._attend_seq(s, pieces, q, out, (k_all, v_all), buffers, scale)
        if self.plan.decodes:  # every rank: over the gathered prefix, as a replicated step would
            out[split:] = decode_attention(q[split:], self.batch, buffers, scale)
        return out.flatten(1)

    def _local_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     buffers: tuple[torch.Tensor, torch.Tensor], scale: float) -> dict[Piece, list[Part]]:
        """Each piece's attention over what this rank has before the exchange: the sequence's cached
        prefix (in the step buffer, gathered) and the piece's own keys (causal)."""
        parts: dict[Piece, list[Part]] = {}
        for i, s in enumerate(self.plan.seqs):
            pieces = [p for p in self.plan.pieces if p.seq == i]
            prefix = [_prefix(s, b, self.store.page_size) for b in buffers] if s.prefix and pieces else None
            for p in pieces:
                rows = slice(p.local, p.local + p.length)
                parts[p] = local_parts(q[rows], prefix, (k[rows], v[rows]), scale)
        return parts

    def _finish_seq(self, s: SplitSeq, pieces: list[Piece], q: torch.Tensor, out: torch.Tensor,
                    new: tuple[torch.Tensor, torch.Tensor], early: dict[Piece, list[Part]], scale: float) -> None:
        """Each piece's part over the step's keys before it (every rank's, exchanged), merged with its early parts."""
        for p in pieces:
            rows, earlier = slice(p.local, p.local + p.length), slice(s.start, s.start + p.offset)
            late = [unmasked_cpu(q[rows], new[0][earlier], new[1][earlier], scale)] if p.offset else []
            out[rows] = merge_parts([*early[p], *late], q.dtype)

    def _attend_seq(self, s: SplitSeq, pieces: list[Piece], q: torch.Tensor, out: torch.Tensor,
                    new: tuple[torch.Tensor, torch.Tensor], buffers: tuple[torch.Tensor, torch.Tensor],
                    scale: float) -> None:
        """Off the CPU: each piece's queries over the keys before it (prefix, then the step's) and its own
        (causal), in one masked call, after the exchange."""
        seen = max(p.offset for p in pieces)
        page = self.store.page_size
        keys = [_before(s, t[s.start: s.start + seen], b, page) for t, b in zip(new, buffers, strict=True)]
        for p in pieces:
            mine = slice(s.start + p.offset, s.start + p.offset + p.length)
            old = [t[: s.prefix + p.offset] for t in keys]
            out[p.local: p.local + p.length] = attend_piece(q[p.local: p.local + p.length], *old,
                                                            new[0][mine], new[1][mine], scale)

    def _start_exchange(self, mine: torch.Tensor) -> tuple[dist.Work, list[torch.Tensor]]:
        """Sends this rank's rows [n, ...] to every rank (asynchronous): the handle and where they land."""
        padded = mine.new_zeros((self.width, *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in self.plan.rows]
        return dist.all_gather(parts, padded, group=self.group, async_op=True), parts

    def _finish_exchange(self, handle: dist.Work, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every flat row of the step's extends, in flat order, once the exchange is done. The clock counts
        the seconds waited for it (the part the early attention did not hide)."""
        started = time.perf_counter()
        handle.wait()
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - started
        gathered = torch.cat([part[: len(rows)] for part, rows in zip(parts, self.plan.rows, strict=True)])
        flat = torch.empty_like(gathered)
        flat[self.plan.perm] = gathered
        return flat


Part = tuple[torch.Tensor, torch.Tensor]  # a part's attention output [L, heads, dim] and its log-sum-exp [L, heads]


def local_parts(q: torch.Tensor, prefix: list[torch.Tensor] | None, own: tuple[torch.Tensor, torch.Tensor],
                scale: float) -> list[Part]:
    """On the CPU, q [L, heads, dim] over every key of ``prefix`` (K and V [P, kv_heads, dim], no mask; None:
    no prefix) and over ``own`` (the queries' own keys, causal), each with its log-sum-exp."""
    parts = [unmasked_cpu(q, *prefix, scale)] if prefix is not None else []
    return [*parts, causal_cpu(q, *own, scale)]


def merge_parts(parts: list[Part], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of the parts' disjoint key sets, in ``dtype``."""
    if len(parts) == 1:
        return parts[0][0].to(dtype)
    out, _ = combine(torch.stack([o.float() for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    return out.to(dtype)


def _prefix(s: SplitSeq, buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """The sequence's cached prefix [prefix, kv_heads, dim] from the step buffer (gathered from its owners)."""
    return gather_pages(buffer, s.prefix_rows, page_size)[0, : s.prefix]


def _before(s: SplitSeq, new: torch.Tensor, buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """The sequence's keys (or values) at positions ``[0, prefix + len(new))``: the prefix's from the
    step buffer (gathered from their owners), then ``new``."""
    return torch.cat([_prefix(s, buffer, page_size), new]) if s.prefix else new


def attend_piece(q: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 scale: float, fused: bool | None = None) -> torch.Tensor:
    """q [L, heads, dim] over every key of ``k_old`` (the positions before the piece, no mask) and of
    ``k_new`` (the piece's own, causal; [L, kv_heads, dim]) -> [L, heads, dim]. ``fused``: the two
    parts merged by log-sum-exp (``split_extend``, the default on CPU, where a mask over every key is
    materialised and slow), rather than one masked call."""
    fused = q.device.type == "cpu" if fused is None else fused
    if k_old.shape[0] == 0:
        return _sdpa(q, k_new, v_new, scale, causal=True)
    if not fused:
        keys, values = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
        q_pos = torch.arange(q.shape[0], device=q.device) + k_old.shape[0]
        mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]
        return _sdpa(q, keys, values, scale, mask=mask)
    return split_extend(q, k_new, v_new, k_old, v_old, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)

