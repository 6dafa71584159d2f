"""CP's short steps (``engine/cp_merge.py``): attention over the keys each rank owns, merged by
log-sum-exp, equals causal attention over every key, for decodes and a short extend in one batch,
with GQA, and where one rank holds no key a query may see (the merge must ignore its zeros)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierserve.cache.cp_pages import PageOwnership
from tierserve.engine.cp_merge import SeqKeys, merge_partials, owned_keys, partial_attention, short_step

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


def test_merged_partials_equal_attention_over_every_key() -> None:
    gen = torch.Generator().manual_seed(0)
    k_logical, v_logical = _logical_pool(16, gen), _logical_pool(16, gen)
    seqs = [SeqKeys(0, 3, 9, [5, 2, 7]),  # an extend of 3 tokens after 9 cached: positions 9..11
            SeqKeys(3, 1, 0, [8]),  # a first token: only rank 0 (page 8's owner) holds a key it sees
            SeqKeys(4, 1, 13, [1, 3, 10, 12])]  # a decode at position 13
    q = torch.randn(5, HEADS, DIM, generator=gen)
    slots = torch.tensor([7 * PAGE + 1, 7 * PAGE + 2, 7 * PAGE + 3, 8 * PAGE, 12 * PAGE + 1])
    outs, lses = [], []
    for rank in range(CP):
        own = PageOwnership(rank, CP)
        keys = owned_keys(own, seqs, slots, PAGE, torch.device("cpu"))
        pool = (_local_pool(k_logical, own), _local_pool(v_logical, own))
        out, lse = partial_attention(q, pool, keys, PAGE, SCALE)
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    for i, seq in enumerate(seqs):
        expected = _reference(q, k_logical, v_logical, seq)
        torch.testing.assert_close(merged[i, : seq.length], expected, rtol=1e-5, atol=1e-5)


def test_owned_keys_name_the_new_tokens_this_rank_writes() -> None:
    seqs = [SeqKeys(0, 2, 6, [4, 5])]
    slots = torch.tensor([5 * PAGE + 2, 5 * PAGE + 3])  # both on page 5: rank 1's local page 2
    mine = owned_keys(PageOwnership(1, CP), seqs, slots, PAGE, torch.device("cpu"))
    theirs = owned_keys(PageOwnership(0, CP), seqs, slots, PAGE, torch.device("cpu"))
    assert mine.write_rows.tolist() == [0, 1] and mine.write_slots.tolist() == [2 * PAGE + 2, 2 * PAGE + 3]
    assert theirs.write_rows.tolist() == [] and theirs.pages.tolist() == [[2]]  # page 4 at local 2


def test_only_steps_of_at_most_a_page_per_sequence_merge() -> None:
    assert short_step([1, 1, PAGE], PAGE)
    assert not short_step([1, PAGE + 1], PAGE)
