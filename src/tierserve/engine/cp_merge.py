"""Context parallelism's short steps: no gather. Every rank attends over the pages it owns and the
ranks merge their partial results (``docs/architecture.md``, Context parallelism, "Short steps").

A step whose every sequence brings at most one page of new tokens (decodes, the last page after a
prefix hit) has too little compute to hide a gather of its whole prefix behind, so instead of
moving the prefix's pages each rank computes, for every query, attention over the keys of the
pages it owns (their softmax-normalised output and its log-sum-exp), and one all-gather of those
small partials per layer lets every rank merge them exactly:
``out = sum_r exp(lse_r - lse) * out_r`` with ``lse = logsumexp_r lse_r``. A token's key is read by
its page's owner only, so each key counts once. The owner writes the step's new K/V into its pool
before attending, as under the gather.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierserve.cache.cp_pages import PageOwnership
from tierserve.model.attention import LayerHooks

QUERY_BLOCK = 256  # queries per score block: bounds the [heads, block, keys] scores of a long span


@dataclass
class MergeClock:
    """Steps served by merging and the seconds their layers spent in the merge's all-gather."""

    steps: int = 0
    seconds: float = 0.0

    def stats(self) -> dict[str, float]:
        return {"cp_merge_steps_total": float(self.steps), "cp_merge_seconds_total": self.seconds}


@dataclass(frozen=True)
class SeqKeys:
    """One sequence of the step: its new tokens' rows in the flat batch, their positions, and
    the logical pages that hold its tokens up to the step's end (in sequence order)."""

    start: int
    length: int
    first_position: int
    pages: list[int]


def short_step(new_tokens: list[int], page_size: int) -> bool:
    """Whether a step merges instead of gathering: every sequence brings at most a page of tokens."""
    return all(n <= page_size for n in new_tokens)


@dataclass
class OwnedKeys:
    """Per-step tables of the keys this rank owns, padded to one batch: ``pages`` [S, P] local
    page ids, ``key_pos`` [S, P * page_size] each slot's position (-1: padding), ``query_rows``
    [S, Q] flat-batch rows (padding: row 0), ``query_pos`` [S, Q] (-1: padding, sees nothing)."""

    pages: torch.Tensor
    key_pos: torch.Tensor
    query_rows: torch.Tensor
    query_pos: torch.Tensor
    write_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    write_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


def owned_keys(own: PageOwnership, seqs: list[SeqKeys], slots: torch.Tensor, page_size: int,
               device: torch.device) -> OwnedKeys:
    """The tables of ``OwnedKeys`` for ``seqs``; ``slots`` [T] are the new tokens' logical slots."""
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
    keys = OwnedKeys(pages.to(device), key_pos.to(device), rows.to(device), query_pos.to(device))
    logical = slots // page_size
    owned_rows = torch.nonzero(logical % own.size == own.rank).flatten()
    keys.write_rows = owned_rows
    keys.write_slots = (logical[owned_rows] // own.size) * page_size + slots[owned_rows] % page_size
    return keys


class MergedAttention:
    """Attention of a short step under CP (``PartialAttention`` of ``model/attention.py``).

    Contract: every rank of ``group`` builds it for the same batch and calls ``attend`` for every
    layer in order; each call runs one all-gather (a fixed shape per step on every rank)."""

    def __init__(self, own: PageOwnership, keys: OwnedKeys, page_size: int, inner: LayerHooks | None,
                 group: object | None = None, clock: MergeClock | None = None) -> None:
        self.own, self.keys, self.page_size, self.inner, self.group = own, keys, page_size, inner, group
        self.clock = clock

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               pool: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] -> [T, heads * dim], merged over the ranks."""
        keys = self.keys
        for store, new in zip(pool, (k, v), strict=True):
            rows = new.reshape(new.shape[0], -1).index_select(0, keys.write_rows)
            store.view(store.shape[0], -1).index_copy_(0, keys.write_slots, rows)
        if self.inner is not None:
            self.inner.after_kv_written(layer_id)
        out, lse = partial_attention(q, pool, keys, self.page_size, scale)
        merged = self._merge(out.float(), lse).to(q.dtype)
        flat = torch.zeros_like(q)
        valid = keys.query_pos >= 0
        flat[keys.query_rows[valid]] = merged[valid]
        return flat.flatten(1)

    def _merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """out [S, Q, H, D], lse [S, Q, H] of this rank -> the exact attention over every rank's keys."""
        started = time.perf_counter()
        mine = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.own.size)]
        dist.all_gather(parts, mine, group=self.group)
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - started
        stacked = torch.stack(parts)
        return merge_partials(stacked[..., :-1], stacked[..., -1])


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [N, ..., D] and lses [N, ...] of N disjoint key sets -> the attention over their union
    (0 where no set has a key)."""
    top = lses.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no rank holds a key: padding
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0).clamp_min(torch.finfo(weights.dtype).tiny)
    return (weights.unsqueeze(-1) * outs).sum(dim=0) / total.unsqueeze(-1)


def partial_attention(q: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor], keys: OwnedKeys, page_size: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over this rank's keys that are at or before its position:
    out [S, Q, heads, dim] (0 where it sees none) and lse [S, Q, heads] (-inf there)."""
    heads, kv_heads = q.shape[1], pool[0].shape[1]
    k_all, v_all = (_read_pages(p, keys.pages, page_size) for p in pool)  # [S, K, kv_heads, dim]
    queries = q[keys.query_rows]  # [S, Q, heads, dim]
    group = heads // kv_heads
    outs, lses = [], []
    for start in range(0, queries.shape[1], QUERY_BLOCK):
        block = slice(start, start + QUERY_BLOCK)
        sees = (keys.key_pos[:, None, :] >= 0) & (keys.key_pos[:, None, :] <= keys.query_pos[:, block, None])
        out, lse = _attend_block(queries[:, block], k_all, v_all, sees, group, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor, group: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, Q, H, D]; k, v [S, K, KVH, D]; sees [S, Q, K] -> out [S, Q, H, D], lse [S, Q, H]."""
    s_, q_len, heads, dim = q.shape
    qg = q.view(s_, q_len, heads // group, group, dim).permute(0, 2, 3, 1, 4)  # [S, KVH, G, Q, D]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [S, KVH, 1, D, K]
    scores = torch.matmul(qg, kt).float() * scale  # [S, KVH, G, Q, K]
    scores = scores.masked_fill(~sees[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees nothing: 0, not NaN
    out = torch.matmul(probs.to(v.dtype), v.permute(0, 2, 1, 3).unsqueeze(2))  # [S, KVH, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(s_, q_len, heads, dim), lse.permute(0, 3, 1, 2).reshape(s_, q_len, heads)


def _read_pages(pool: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[S, P] local page ids -> [S, P * page_size, kv_heads, dim] copies of those pages."""
    heads, dim = pool.shape[1], pool.shape[2]
    rows = pool.view(-1, page_size * heads * dim).index_select(0, pages.reshape(-1))
    return rows.view(pages.shape[0], pages.shape[1] * page_size, heads, dim)
