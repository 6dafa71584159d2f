"""CP's merged attention (``engine/cp/merge.py``, ``engine/cp/partial.py``): attention over the keys
each rank owns, merged by log-sum-exp, equals causal attention over every key, for decodes and
extends in one batch, with GQA, and where one rank holds no key a query may see (the merge must
ignore its zeros); both readers (the padded batch of short steps, the split per sequence of layer 0
of longer steps; both run the fused CPU kernel)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tierserve.cache.sharded.cp_pages import PageOwnership
from tierserve.engine.cp import partial
from tierserve.engine.cp.merge import own_writes, short_step
from tierserve.engine.cp.partial import BatchedKeys, SeqKeys, SplitKeys
from tierserve.model.partial_attention import combine

PAGE, HEADS, KV_HEADS, DIM, CP = 4, 4, 2, 8, 2
SCALE = DIM**-0.5


def _logical_pool(pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(pages * PAGE, KV_HEADS, DIM, generator=gen)


def _local_pool(logical: torch.Tensor, own: PageOwnership) -> torch.Tensor:
    """Rank ``own.rank``'s pool: its logical pages at their local slots (others stay zero)."""
    pages = logical.shape[0] // PAGE
    local = torch.zeros((pages // own.size + 1) * PAGE, KV_HEADS, DIM)
    for p in range(pages):
        if own.owns(p):
            local[own.local(p) * PAGE:(own.local(p) + 1) * PAGE] = logical[p * PAGE:(p + 1) * PAGE]
    return local


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqKeys) -> torch.Tensor:
    """Causal attention of the sequence's new tokens over its keys in sequence order."""
    slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in seq.pages])
    end = seq.first_position + seq.length
    keys, values = k[slots][:end].transpose(0, 1)[None], v[slots][:end].transpose(0, 1)[None]
    queries = q[seq.start:seq.start + seq.length].transpose(0, 1)[None]
    q_pos = torch.arange(seq.first_position, end)
    mask = torch.arange(end)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=SCALE, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(("reader", "mask_elements"),
                         [(BatchedKeys, partial.MASK_ELEMENTS), (BatchedKeys, 1), (SplitKeys, partial.MASK_ELEMENTS),
                          (functools.partial(BatchedKeys, fused=False), partial.MASK_ELEMENTS)])
def test_merged_partials_equal_attention_over_every_key(reader, mask_elements: int, monkeypatch) -> None:
    """``mask_elements`` 1: ``BatchedKeys`` pads each sequence alone (a block per sequence);
    ``fused=False``: the unfused path other devices take."""
    monkeypatch.setattr(partial, "MASK_ELEMENTS", mask_elements)
    gen = torch.Generator().manual_seed(0)
    k_logical, v_logical = _logical_pool(16, gen), _logical_pool(16, gen)
    seqs = [SeqKeys(0, 3, 9, [5, 2, 7]),  # an extend of 3 tokens after 9 cached: positions 9..11
            SeqKeys(3, 1, 0, [8]),  # a first token: only rank 0 (page 8's owner) holds a key it sees
            SeqKeys(4, 1, 13, [1, 3, 10, 12]),  # a decode at position 13
            SeqKeys(5, 10, 2, [4, 6, 9])]  # a longer extend: positions 2..11, over 2 pages of new tokens
    q = torch.randn(15, HEADS, DIM, generator=gen)
    outs, lses = [], []
    for rank in range(CP):
        own = PageOwnership(rank, CP)
        pool = (_local_pool(k_logical, own), _local_pool(v_logical, own))
        out, lse = reader(own, seqs, PAGE, torch.device("cpu")).attend(q, pool, SCALE)
        outs.append(out)
        lses.append(lse)
    merged, _ = combine(torch.stack(outs), torch.stack(lses))
    for seq in seqs:
        expected = _reference(q, k_logical, v_logical, seq)
        torch.testing.assert_close(merged[seq.start:seq.start + seq.length], expected, rtol=1e-5, atol=1e-5)


def test_an_average_of_the_partials_is_not_the_attention() -> None:
    """The weights matter: the test above would catch a merge that ignores the log-sum-exps."""
    outs, lses = torch.tensor([[[1.0]], [[3.0]]]), torch.tensor([[0.0], [2.0]])
    merged, lse = combine(outs, lses)
    assert merged.item() != 2.0 and abs(lse.item() - torch.logsumexp(torch.tensor([0.0, 2.0]), 0).item()) < 1e-6


def test_a_rank_writes_the_new_tokens_of_the_pages_it_owns() -> None:
    slots = torch.tensor([4 * PAGE + 3, 5 * PAGE + 0, 5 * PAGE + 1])  # page 4 is rank 0's, page 5 rank 1's
    rows, local = own_writes(PageOwnership(1, CP), slots, PAGE)
    assert rows.tolist() == [1, 2] and local.tolist() == [2 * PAGE, 2 * PAGE + 1]  # page 5 at local 2
    rows, local = own_writes(PageOwnership(0, CP), slots, PAGE)
    assert rows.tolist() == [0] and local.tolist() == [2 * PAGE + 3]


def test_only_steps_of_at_most_a_page_per_sequence_merge_every_layer() -> None:
    assert short_step([1, 1, PAGE], PAGE)
    assert not short_step([1, PAGE + 1], PAGE)
