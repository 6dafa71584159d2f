"""A prompt chunk's attention over a cached prefix (``PagedAttention._extend``): on the CPU, the split form (the
prefix without a mask, the chunk causal, merged by log-sum-exp) equals the masked attention it replaces, and a
long chunk builds no ``[chunk, prefix + chunk]`` mask (issue 28: that mask cost more than a TP rank's heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tierserve.model import attention
from tierserve.model.attention import AttentionBatch, ExtendSpan, PagedAttention

DIM = 8


class _Pool:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def _case(prefix: int, chunk: int, heads: int, kv_heads: int, page: int, seed: int):
    """A sequence's prefix K/V in shuffled pages of a pool with spare pages, and the chunk's q, k, v."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-(prefix + chunk) // page)
    table = torch.randperm(pages + 3, generator=g)[:pages]
    slots = (table[:, None] * page + torch.arange(page)).flatten()[: prefix + chunk]
    k_all, v_all = (torch.randn(prefix + chunk, kv_heads, DIM, generator=g) for _ in range(2))
    pool = _Pool(*(torch.randn((pages + 3) * page, kv_heads, DIM, generator=g) for _ in range(2)))
    pool.k[slots[:prefix]], pool.v[slots[:prefix]] = k_all[:prefix], v_all[:prefix]
    q = torch.randn(chunk, heads, DIM, generator=g)
    batch = AttentionBatch(page, slots[prefix:], [ExtendSpan(0, chunk, prefix, table)])
    return q, k_all, v_all, pool, batch


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, hide: bool) -> torch.Tensor:
    """float64 softmax attention of positions prefix.. over all keys up to each, slot 0 hidden from
    every position but 0 when ``hide``."""
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * DIM**-0.5
    q_pos = torch.arange(q.shape[0])[:, None] + prefix
    cols = torch.arange(k.shape[0])[None, :]
    sees = (cols <= q_pos) & ((cols > 0) | (q_pos == 0) | (not hide))
    probs = scores.masked_fill(~sees, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).float()


def _forward(q, k, v, pool, batch, hide: bool) -> torch.Tensor:
    batch.hide_first_slot = hide
    layer = PagedAttention(0, q.shape[1], k.shape[1], DIM)
    return layer(q, k, v, batch, pool).view(q.shape)


@pytest.mark.parametrize("prefix, chunk", [(1, 1), (1, 9), (2, 5), (16, 16), (37, 1), (100, 23), (700, 300)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 1), (6, 2), (2, 2)])
@pytest.mark.parametrize("hide", [False, True])
def test_split_form_equals_masked_attention(monkeypatch, prefix: int, chunk: int, heads: int, kv_heads: int,
                                            hide: bool) -> None:
    """Every chunk over a prefix takes the split form here (threshold 0), at any size, GQA and not."""
    monkeypatch.setattr(attention, "MIN_SPLIT_MASK", 0)
    q, k_all, v_all, pool, batch = _case(prefix, chunk, heads, kv_heads, page=4, seed=prefix * 1000 + chunk)
    got = _forward(q, k_all[prefix:], v_all[prefix:], pool, batch, hide)
    torch.testing.assert_close(got, _reference(q, k_all, v_all, prefix, hide), atol=2e-5, rtol=1e-4)


def test_long_chunk_builds_no_prefix_mask(monkeypatch) -> None:
    """At the default threshold a 512-token chunk over a 1024-token prefix attends without any mask (SDPA
    sees none of [512, 1536]); a 4-token chunk over 16 still takes the masked form."""
    masks: list[tuple[int, ...]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            masks.append(tuple(kwargs["attn_mask"].shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for hide in (False, True):
        q, k_all, v_all, pool, batch = _case(1024, 512, 4, 2, page=16, seed=7)
        got = _forward(q, k_all[1024:], v_all[1024:], pool, batch, hide)
        torch.testing.assert_close(got, _reference(q, k_all, v_all, 1024, hide), atol=2e-5, rtol=1e-4)
    assert masks == []
    q, k_all, v_all, pool, batch = _case(16, 4, 4, 2, page=16, seed=8)
    _forward(q, k_all[16:], v_all[16:], pool, batch, False)
    assert masks == [(4, 20)]
