"""Attention over a paged KV pool, for a flat batch mixing prefill chunks and decode tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.model.partial_attention import causal_cpu, combine, unmasked_cpu

# On the CPU, a chunk over a prefix attends in two unmasked parts (``split_extend``) once the mask of the
# masked form (chunk x (prefix + chunk) elements) would reach this size; below it both take a few ms at most
# and the masked one is ahead (a second kernel call and the merge cost more than the small mask), above it
# the split is 1.2-3.5x faster (benchmarks/extend_attention.py, docs/tp.md).
MIN_SPLIT_MASK = 1 << 18


class KVStore(Protocol):
    """What attention needs from a KV pool: per-layer K and V views of shape [slots, kv_heads, head_dim]."""

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerHooks(Protocol):
    """Per-layer signals for work that overlaps the forward pass.

    ``before_attention(i)`` blocks until layer i's KV pages that are being loaded (L2 -> L1) are in
    place; ``after_kv_written(i)`` tells a consumer (e.g. the KV sender) that layer i is in the pool.
    """

    def before_attention(self, layer_id: int) -> None: ...

    def after_kv_written(self, layer_id: int) -> None: ...


class PartialAttention(Protocol):
    """Attention of some layers computed elsewhere (context parallelism's merged attention,
    ``engine/cp/merge.py``): for a layer it ``covers``, ``attend`` stores the step's K/V where they
    belong, signals ``after_kv_written`` and returns [T, heads * dim]."""

    def covers(self, layer_id: int) -> bool: ...

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> torch.Tensor: ...


@dataclass
class ExtendSpan:
    """One sequence's new tokens in the flat batch (a prompt chunk).

    ``kv_pages`` lists the pool pages holding all ``prefix_len + length`` tokens, needed only when
    earlier tokens are already in the pool (``prefix_len > 0``).
    """

    start: int
    length: int
    prefix_len: int
    kv_pages: torch.Tensor | None = None


@dataclass
class AttentionBatch:
    """Where a forward pass writes and reads KV.

    ``out_slots`` [T] is the pool slot (page * page_size + offset) of each token's K/V. Tokens of
    extend spans come first in the flat batch, then one token per decoding sequence from
    ``decode_start`` on. ``decode_pages`` [B, P] is each decoding sequence's page table, padded;
    ``decode_mask`` [B, 1, 1, P * page_size] hides padding and slots past the sequence's length.
    Reads gather whole pages: one large row per page is far faster than one row per token.
    ``partial`` takes over the layers it covers (context parallelism's merged attention).
    ``hide_first_slot``: position 0's K/V is seen by position 0 alone (an EAGLE head's first row,
    which has no target feature: ``engine/spec/eagle.py``).
    """

    page_size: int
    out_slots: torch.Tensor
    extends: list[ExtendSpan] = field(default_factory=list)
    decode_start: int = 0
    decode_pages: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    hooks: LayerHooks | None = None
    partial: PartialAttention | None = None
    hide_first_slot: bool = False


class PagedAttention(nn.Module):
    """Stores this layer's K/V for the batch's tokens in the pool, then attends over the pool."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, kv: KVStore
    ) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim]; returns [T, heads * dim]."""
        k_pool, v_pool = kv.layer(self.layer_id)
        if batch.hooks is not None:
            batch.hooks.before_attention(self.layer_id)
        if batch.partial is not None and batch.partial.covers(self.layer_id):
            return batch.partial.attend(self.layer_id, q, k, v, self.scale)
        _store(k_pool, batch.out_slots, k)
        _store(v_pool, batch.out_slots, v)
        if batch.hooks is not None:
            batch.hooks.after_kv_written(self.layer_id)
        out = torch.empty_like(q)
        for span in batch.extends:
            end = span.start + span.length
            new = q[span.start : end], k[span.start : end], v[span.start : end]
            out[span.start : end] = self._extend(*new, span, batch, k_pool, v_pool)
        if batch.decode_pages is not None:
            out[batch.decode_start :] = self._decode(q[batch.decode_start :], batch, k_pool, v_pool)
        return out.flatten(1)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: ExtendSpan, batch: AttentionBatch,
        k_pool: torch.Tensor, v_pool: torch.Tensor,
    ) -> torch.Tensor:
        if span.prefix_len == 0 and not batch.hide_first_slot:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        # Slot 0, when hidden, is seen by position 0 alone, which is never a query after a prefix.
        first = int(batch.hide_first_slot)
        if q.device.type == "cpu" and span.prefix_len > first and _mask_size(span) >= MIN_SPLIT_MASK:
            prefix = [prefix_keys(p, span, batch.page_size, first) for p in (k_pool, v_pool)]
            return split_extend(q, k, v, prefix[0], prefix[1], self.scale)
        return masked_extend(q, span, batch, (k, v), (k_pool, v_pool), self.scale)

    def _decode(
        self, q: torch.Tensor, batch: AttentionBatch, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        return decode_attention(q, batch, (k_pool, v_pool), self.scale)


def decode_attention(q: torch.Tensor, batch: AttentionBatch, pool: tuple[torch.Tensor, torch.Tensor],
                     scale: float) -> torch.Tensor:
    """The batch's decode tokens q [B, heads, dim] over their pages (``decode_pages``, ``decode_mask``)."""
    k, v = (gather_pages(p, batch.decode_pages, batch.page_size).transpose(1, 2) for p in pool)
    mask = batch.decode_mask
    if batch.hide_first_slot:  # a decode is never at position 0
        mask = mask.clone()
        mask[..., 0] = False
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _mask_size(span: ExtendSpan) -> int:
    return span.length * (span.prefix_len + span.length)


def split_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                 v_prefix: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's queries q [Q, heads, dim] over its prefix's keys (k_prefix, v_prefix [P, kv_heads, dim], P > 0,
    every query sees every one: no mask) and its own (k, v [Q, kv_heads, dim], causal), merged by log-sum-exp
    (CPU only) -> [Q, heads, dim] in q's dtype. Builds no [Q, P + Q] mask: on a long prompt that mask, the
    same for every head, cost more than the attention of a tensor-parallel rank's heads (issue 28)."""
    outs, lses = zip(unmasked_cpu(q, k_prefix, v_prefix, scale), causal_cpu(q, k, v, scale), strict=True)
    out, _ = combine(torch.stack([o.float() for o in outs]), torch.stack(lses))
    return out.to(q.dtype)


def prefix_keys(pool: torch.Tensor, span: ExtendSpan, page_size: int, first: int = 0) -> torch.Tensor:
    """Positions ``first``..``prefix_len - 1`` of the span's sequence from one layer's pool, [P, kv_heads, dim]."""
    pages = span.kv_pages[..., : -(-span.prefix_len // page_size)]
    return gather_pages(pool, pages, page_size)[0, first : span.prefix_len]


def masked_extend(q: torch.Tensor, span: ExtendSpan, batch: AttentionBatch, new: tuple[torch.Tensor, torch.Tensor],
                  pool: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """A chunk's queries q [Q, heads, dim] over its prefix and its own keys (``new``, [Q, kv_heads, dim]) with
    one [Q, prefix + Q] mask: a chunk without a prefix whose slot 0 is hidden, small chunks over short
    prefixes (where the mask costs less than a second kernel call and the merge) and devices other than the
    CPU (SDPA there returns no log-sum-exp to merge with)."""
    kv_len = span.prefix_len + span.length
    if span.prefix_len:
        k, v = (gather_pages(p, span.kv_pages, batch.page_size)[:, :kv_len].transpose(1, 2) for p in pool)
    else:
        k, v = (t.transpose(0, 1).unsqueeze(0) for t in new)
    q_pos = torch.arange(span.length, device=q.device) + span.prefix_len
    cols = torch.arange(kv_len, device=q.device)[None, :]
    mask = cols <= q_pos[:, None]
    if batch.hide_first_slot:
        mask &= (cols > 0) | (q_pos[:, None] == 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def _store(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool[slots] = values, as one row copy per token (faster than 3-D advanced indexing)."""
    pool.view(pool.shape[0], -1).index_copy_(0, slots, values.reshape(values.shape[0], -1))


def gather_pages(pool: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., P] page ids -> [prod(...), P * page_size, heads, dim] copies of those pages."""
    heads, dim = pool.shape[1], pool.shape[2]
    rows = pool.view(-1, page_size * heads * dim).index_select(0, pages.reshape(-1))
    return rows.view(-1, pages.shape[-1] * page_size, heads, dim)
