"""The attention a CP rank computes over the keys it owns, with its log-sum-exp, for the merge of
``engine/cp/merge.py`` (``docs/cp.md``, "Merged attention").

Two readers of the same answer: ``BatchedKeys`` pads every sequence of a short step into one batch
(decodes: one query each, many sequences); ``SplitKeys`` takes one sequence at a time and splits its
keys into those before the step (every query sees them: no mask) and the step's own (causal), so a
long span runs the fused CPU attention kernel unmasked over most of its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.model.attention import gather_pages
from tierserve.model.partial_attention import combine, fused_cpu

# Queries x keys of one block of sequences (padded): bounds its mask and, off the CPU, its scores. A
# short step's sequences bring at most a page of queries each, so a block is many decodes or a few pages.
MASK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SeqKeys:
    """One sequence of the step: its new tokens' rows in the flat batch (``start``, ``length``),
    the position of the first, and the logical pages holding its tokens up to the step's end."""

    start: int
    length: int
    first_position: int
    pages: list[int]


class BatchedKeys:
    """Every sequence's owned keys padded into batches (blocks of at most ``MASK_ELEMENTS`` queries x
    keys), each one call of the fused CPU attention kernel per layer (``fused``; default: on the CPU,
    unfused elsewhere). The tables and masks are built once per step, with a few tensor operations
    per sequence (none per page), and serve every layer: a short step's compute is small, so its
    fixed costs are its time (issue 28: a page after a 32K-token L3 hit took 2x CP=1's step)."""

    def __init__(self, own: PageOwnership, seqs: list[SeqKeys], page_size: int, device: torch.device,
                 fused: bool | None = None) -> None:
        owned = [owned_pages(own, s.pages) for s in seqs]
        self.page_size = page_size
        self.fused = device.type == "cpu" if fused is None else fused
        self.blocks = [_KeyBlock.of([seqs[i] for i in b], [owned[i] for i in b], page_size, device)
                       for b in _blocks([s.length for s in seqs], [len(o[0]) * page_size for o in owned])]

    def attend(self, q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, dim] -> out [T, heads, dim] (0 where a query sees no key here), lse [T, heads]
        (-inf there)."""
        flat_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        flat_lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        for block in self.blocks:
            out, lse = block.attend(q, pool, scale, self.page_size, self.fused)
            flat_out[block.flat_rows], flat_lse[block.flat_rows] = out, lse
        return flat_out, flat_lse


@dataclass
class _KeyBlock:
    """Sequences padded together: ``pages`` [S, P] local page ids, ``rows`` [S, Q] their queries'
    flat rows (padding: row 0), ``sees`` [S, Q, P * page_size] which key each query sees (padding
    sees none), ``valid`` [S, Q] the real queries and ``flat_rows`` their rows."""

    pages: torch.Tensor
    rows: torch.Tensor
    sees: torch.Tensor
    valid: torch.Tensor
    flat_rows: torch.Tensor
    _bias: dict[tuple[int, torch.dtype], torch.Tensor]

    @classmethod
    def of(cls, seqs: list[SeqKeys], owned: list[tuple[torch.Tensor, torch.Tensor]], page_size: int,
           device: torch.device) -> _KeyBlock:
        width, longest = max(1, max(len(local) for _, local in owned)), max(s.length for s in seqs)
        pages = torch.zeros(len(seqs), width, dtype=torch.int64)
        key_pos = torch.full((len(seqs), width * page_size), -1, dtype=torch.int64)
        rows = torch.zeros(len(seqs), longest, dtype=torch.int64)
        query_pos = torch.full((len(seqs), longest), -1, dtype=torch.int64)
        offsets = torch.arange(page_size)
        for k, (s, (index, local)) in enumerate(zip(seqs, owned, strict=True)):
            pages[k, : len(local)] = local
            key_pos[k, : len(index) * page_size] = (index[:, None] * page_size + offsets).flatten()
            rows[k, : s.length] = torch.arange(s.start, s.start + s.length)
            query_pos[k, : s.length] = torch.arange(s.first_position, s.first_position + s.length)
        sees = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] <= query_pos[:, :, None])
        valid = query_pos >= 0
        return cls(pages.to(device), rows.to(device), sees.to(device), valid.to(device), rows[valid].to(device), {})

    def attend(self, q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], scale: float, page_size: int,
               fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's real queries: out [N, heads, dim] float32, lse [N, heads] (-inf: sees no key)."""
        k, v = (gather_pages(p, self.pages, page_size) for p in pool)  # [S, K, kv_heads, dim]
        queries = q[self.rows]  # [S, Q, heads, dim]
        if fused:
            out, lse = _fused_batch(queries, k, v, self._mask(q.shape[1] // k.shape[2], q.dtype), scale)
            lse = lse.masked_fill(~self.sees.any(dim=-1)[..., None], float("-inf"))  # the kernel gives 0
        else:
            out, lse = _attend_block(queries, k, v, self.sees, scale)
        return out[self.valid].float(), lse[self.valid].float()

    def _mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """``sees`` as the fused kernel's additive mask [S, 1, group * Q, K] (each KV head's ``group``
        query heads folded into its queries), built at the step's first layer for all of them."""
        key = (group, dtype)
        if key not in self._bias:
            sees = self.sees.repeat(1, group, 1)[:, None]
            bias = torch.zeros(sees.shape, dtype=dtype, device=sees.device)
            self._bias[key] = bias.masked_fill_(~sees, float("-inf"))
        return self._bias[key]


def owned_pages(own: PageOwnership, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a sequence's logical ``pages``, the indexes of those this rank owns and their local ids."""
    logical = torch.tensor(pages, dtype=torch.int64)
    index = torch.nonzero(logical % own.size == own.rank).flatten()
    return index, logical[index] // own.size


def _blocks(queries: list[int], keys: list[int]) -> list[list[int]]:
    """Consecutive sequences grouped so that each group's padded queries x keys stay within
    ``MASK_ELEMENTS`` (a sequence alone may exceed it)."""
    groups: list[list[int]] = [[]]
    most_q = most_k = 0
    for i, (nq, nk) in enumerate(zip(queries, keys, strict=True)):
        q, k = max(most_q, nq), max(most_k, nk)
        if groups[-1] and (len(groups[-1]) + 1) * q * k > MASK_ELEMENTS:
            groups.append([])
            q, k = nq, nk
        groups[-1].append(i)
        most_q, most_k = q, k
    return groups


class SplitKeys:
    """Each sequence's owned keys as token slots of the local pool: ``old`` (positions before the
    step, seen by every query of it) and ``new`` (the step's, seen causally), with positions."""

    def __init__(self, own: PageOwnership, seqs: list[SeqKeys], page_size: int, device: torch.device) -> None:
        self.seqs = seqs
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for s in seqs:
            positions, slots = _owned_tokens(own, s, page_size)
            old = positions < s.first_position
            self.parts.append((slots[old].to(device), slots[~old].to(device), positions[~old].to(device)))

    def attend(self, q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``BatchedKeys.attend``."""
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        for s, (old, new, new_pos) in zip(self.seqs, self.parts, strict=True):
            rows = slice(s.start, s.start + s.length)
            q_pos = torch.arange(s.first_position, s.first_position + s.length, device=q.device)
            parts = [_attend_tokens(q[rows], pool, old, None, scale),
                     _attend_tokens(q[rows], pool, new, new_pos[None, :] <= q_pos[:, None], scale)]
            out[rows], lse[rows] = combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        return out, lse


def _owned_tokens(own: PageOwnership, s: SeqKeys, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (up to the step's end) on pages this rank owns, and their local pool slots."""
    end = s.first_position + s.length
    index, local = owned_pages(own, s.pages)
    offsets = torch.arange(page_size)
    positions = (index[:, None] * page_size + offsets).flatten()
    slots = (local[:, None] * page_size + offsets).flatten()
    keep = positions < end
    return positions[keep], slots[keep]


def _attend_tokens(q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor,
                   sees: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, heads, dim] over the keys at ``slots`` (``sees`` [Q, K]: which each query sees; None:
    all) -> out [Q, heads, dim] float32, lse [Q, heads]."""
    if slots.numel() == 0:
        return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                torch.full(q.shape[:2], float("-inf"), device=q.device))
    k, v = (p.index_select(0, slots) for p in pool)  # [K, kv_heads, dim]
    if q.device.type != "cpu":  # the fused kernel with a log-sum-exp is the CPU one; elsewhere, unfused
        full = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device) if sees is None else sees
        out, lse = _attend_block(q[None], k[None], v[None], full[None], scale)
        return out[0].float(), lse[0]
    return fused_cpu(q, k, v, sees, scale)


def _fused_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, Q, H, D]; k, v [S, K, KVH, D]; mask [S, 1, G * Q, K] additive -> out [S, Q, H, D], lse
    [S, Q, H], by the fused CPU kernel with each KV head's G query heads folded into its queries
    (no copy of the keys per query head). A query that sees no key comes back as 0 and lse 0."""
    s_, q_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qf = q.reshape(s_, q_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(s_, kv_heads, group * q_len, dim)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)[:2]
    out = out.reshape(s_, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(s_, q_len, heads, dim)
    return out, lse.reshape(s_, kv_heads, group, q_len).permute(0, 3, 1, 2).reshape(s_, q_len, heads)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, Q, H, D]; k, v [S, K, KVH, D]; sees [S, Q, K] -> out [S, Q, H, D], lse [S, Q, H]."""
    s_, q_len, heads, dim = q.shape
    group = heads // k.shape[2]
    qg = q.reshape(s_, q_len, heads // group, group, dim).permute(0, 2, 3, 1, 4)  # [S, KVH, G, Q, D]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [S, KVH, 1, D, K]
    scores = torch.matmul(qg, kt).float() * scale  # [S, KVH, G, Q, K]
    scores = scores.masked_fill(~sees[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees nothing: 0, not NaN
    out = torch.matmul(probs.to(v.dtype), v.permute(0, 2, 1, 3).unsqueeze(2))  # [S, KVH, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(s_, q_len, heads, dim), lse.permute(0, 3, 1, 2).reshape(s_, q_len, heads)

