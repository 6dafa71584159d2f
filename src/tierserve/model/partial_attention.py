"""Attention over part of a sequence's keys with its log-sum-exp, and the merge of such parts.

Attention over disjoint key sets, each with its log-sum-exp, merges exactly into the attention over their
union (``combine``). Two users: ``PagedAttention`` splits a chunk's keys into its prefix (every query sees
every key: no mask) and its own (causal), so no ``[chunk, prefix + chunk]`` mask is built per layer; context
parallelism merges the parts each rank computes over the keys it owns (``engine/cp``, docs/cp.md).

The fused kernel that returns the log-sum-exp is PyTorch's CPU flash attention
(``_scaled_dot_product_flash_attention_for_cpu``); SDPA on CUDA does not return it publicly, so callers keep
another form off the CPU.
"""

from __future__ import annotations

import torch

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, heads, dim]; k, v [K, kv_heads, dim]; ``sees`` [Q, K] which key each query sees (None: all)
    -> out [Q, heads, dim] float32, lse [Q, heads] (a row that sees nothing: 0 and -inf, so a merge
    ignores it; the kernel itself gives 0 and 0)."""
    qh, kh, vh = _per_query_head(q, k, v)
    bias = None
    if sees is not None:
        bias = torch.zeros(sees.shape, dtype=q.dtype, device=q.device).masked_fill_(~sees, float("-inf"))
    out, lse = _FLASH_CPU(qh, kh, vh, attn_mask=bias, scale=scale)[:2]
    out, lse = out[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()
    if sees is not None:
        lse = lse.masked_fill(~sees.any(dim=1)[:, None], float("-inf"))
    return out, lse


def unmasked_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query over every key, on the CPU: q [Q, heads, dim]; k, v [K, kv_heads, dim] (K > 0) -> out
    [Q, heads, dim] in q's dtype, lse [Q, heads] float32. Each KV head's query heads are folded into its
    queries, so no key is copied per query head."""
    q_len, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qf = q.reshape(q_len, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * q_len, dim)
    out, lse = _FLASH_CPU(qf, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)[:2]
    out = out.reshape(kv_heads, group, q_len, dim).permute(2, 0, 1, 3).reshape(q_len, heads, dim)
    return out, lse.reshape(kv_heads, group, q_len).permute(2, 0, 1).reshape(q_len, heads)


def causal_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Query i over keys 0..i, on the CPU: q [Q, heads, dim]; k, v [Q, kv_heads, dim] -> out [Q, heads, dim]
    in q's dtype, lse [Q, heads] float32. The keys are copied per query head (only the chunk's own keys;
    folding heads into queries would break the causal diagonal)."""
    qh, kh, vh = _per_query_head(q, k, v)
    out, lse = _FLASH_CPU(qh, kh, vh, is_causal=True, scale=scale)[:2]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _per_query_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [Q, heads, dim], k and v [K, kv_heads, dim] as the kernel takes them: [1, heads, Q or K, dim], each
    KV head repeated for its query heads."""
    group = q.shape[1] // k.shape[1]
    return tuple(t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))


def combine(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, ..., D] and lses [N, ...] of attention over N disjoint key sets -> the attention over
    their union and its lse (0 and -inf where no set has a key)."""
    top = lses.max(dim=0).values
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lses - safe)
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / total.clamp_min(torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, torch.log(total) + safe
