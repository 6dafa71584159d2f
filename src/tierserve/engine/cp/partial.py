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

QUERY_BLOCK = 256  # queries per score block of the unfused path: bounds [heads, block, keys]


@dataclass(frozen=True)
class SeqKeys:
    """One sequence of the step: its new tokens' rows in the flat batch (``start``, ``length``),
    the position of the first, and the logical pages holding its tokens up to the step's end."""

    start: int
    length: int
    first_position: int
    pages: list[int]


class BatchedKeys:
    """Every sequence's owned keys padded into one batch: ``pages`` [S, P] local page ids,
    ``key_pos`` [S, P * page_size] each slot's position (-1: padding), ``query_rows`` [S, Q] flat
    rows (padding: row 0), ``query_pos`` [S, Q] (-1: padding, sees nothing)."""

    def __init__(self, own: PageOwnership, seqs: list[SeqKeys], page_size: int, device: torch.device) -> None:
        mine = [[(i, own.local(p)) for i, p in enumerate(s.pages) if own.owns(p)] for s in seqs]
        width, longest = max(1, max(len(m) for m in mine)), max(s.length for s in seqs)
        pages = torch.zeros(len(seqs), width, dtype=torch.int64)
        key_pos = torch.full((len(seqs), width * page_size), -1, dtype=torch.int64)
        rows = torch.zeros(len(seqs), longest, dtype=torch.int64)
        query_pos = torch.full((len(seqs), longest), -1, dtype=torch.int64)
        offsets = torch.arange(page_size)
        for k, (s, owned) in enumerate(zip(seqs, mine, strict=True)):
            for j, (i, local) in enumerate(owned):
                pages[k, j] = local
                key_pos[k, j * page_size:(j + 1) * page_size] = i * page_size + offsets
            rows[k, : s.length] = torch.arange(s.start, s.start + s.length)
            query_pos[k, : s.length] = torch.arange(s.first_position, s.first_position + s.length)
        self.page_size = page_size
        self.pages, self.key_pos = pages.to(device), key_pos.to(device)
        self.query_rows, self.query_pos = rows.to(device), query_pos.to(device)

    def attend(self, q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, dim] -> out [T, heads, dim] (0 where a query sees no key here), lse [T, heads]
        (-inf there)."""
        k_all, v_all = (gather_pages(p, self.pages, self.page_size) for p in pool)  # [S, K, kv_heads, dim]
        queries = q[self.query_rows]  # [S, Q, heads, dim]
        outs, lses = [], []
        for start in range(0, queries.shape[1], QUERY_BLOCK):
            block = slice(start, start + QUERY_BLOCK)
            sees = (self.key_pos[:, None, :] >= 0) & (self.key_pos[:, None, :] <= self.query_pos[:, block, None])
            out, lse = _attend_block(queries[:, block], k_all, v_all, sees, scale)
            outs.append(out)
            lses.append(lse)
        valid = self.query_pos >= 0
        flat_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        flat_lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
        flat_out[self.query_rows[valid]] = torch.cat(outs, dim=1)[valid].float()
        flat_lse[self.query_rows[valid]] = torch.cat(lses, dim=1)[valid]
        return flat_out, flat_lse


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


def combine(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, ..., D] and lses [N, ...] of attention over N disjoint key sets -> the attention over
    their union and its lse (0 and -inf where no set has a key)."""
    top = lses.max(dim=0).values
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - safe)
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, torch.log(total) + safe


def _owned_tokens(own: PageOwnership, s: SeqKeys, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (up to the step's end) on pages this rank owns, and their local pool slots."""
    end = s.first_position + s.length
    owned = [(i, own.local(p)) for i, p in enumerate(s.pages) if own.owns(p)]
    if not owned:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    index, local = (torch.tensor(c, dtype=torch.int64) for c in zip(*owned, strict=True))
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
    return _fused_cpu(q, k, v, sees, scale)


def _fused_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor | None,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention, which also returns the log-sum-exp (a row that sees nothing
    comes back as 0 and lse 0: set to -inf so a merge ignores it)."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    bias = None
    if sees is not None:
        bias = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(~sees, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, attn_mask=bias, scale=scale)
    out, lse = out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()
    if sees is not None:
        lse = lse.masked_fill(~sees.any(dim=1)[:, None], float("-inf"))
    return out, lse


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

