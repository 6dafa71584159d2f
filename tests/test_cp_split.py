"""CP's split step (``engine/cp/split.py``): the ranks divide a long step's new tokens in zigzag
chunks; the pieces every rank attends, put together, equal causal attention over every key; and
through the OpenAI API at CP 2 and 4, long steps split (fresh prompts, a later chunk over a prefix,
a prompt extending a cached one, decodes in the same steps) with greedy answers equal to
``transformers``; a CP 2 prefill node whose steps split hands every token's KV, once, to a decode node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import metrics
from helpers.pd_nodes import DECODE_ARGS, NODE_ARGS, TOKEN_BYTES, reference, run_all
from helpers.polling import poll_settled
from helpers.processes import NodeProcess
from helpers.rank_servers import HEADS, TPServer, complete_all, hf_greedy, start_server, token_ids
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve.engine.cp.split import (
    SPLIT_MIN_TOKENS,
    SplitPlan,
    SplitSeq,
    attend_piece,
    local_parts,
    merge_parts,
    zigzag,
)
from tierserve.launch import free_port
from tierserve.model.partial_attention import unmasked_cpu

Q_HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = DIM**-0.5
CHUNK = 2 * SPLIT_MIN_TOKENS  # a prompt's chunks are long enough to split
DEADLINE_S = 30.0
SHORT_DECODES = 400  # the short prompt's tokens: it decodes while the long prompts prefill


@pytest.mark.parametrize(("length", "size"), [(1, 2), (3, 4), (17, 2), (64, 4), (1000, 3)])
def test_zigzag_covers_every_token_once_and_rank_0_holds_the_last(length: int, size: int) -> None:
    chunks = zigzag(length, size)
    taken = sorted(i for rank in chunks for begin, end in rank for i in range(begin, end))
    assert taken == list(range(length))
    assert any(begin <= length - 1 < end for begin, end in chunks[0])


def test_zigzag_gives_every_rank_the_same_causal_work() -> None:
    """A query at offset i sees prefix + i + 1 keys: the pairs of chunks cost every rank the same."""
    prefix, length, size = 1000, 4096, 4
    work = [sum(prefix + i + 1 for begin, end in rank for i in range(begin, end)) for rank in zigzag(length, size)]
    assert max(work) == min(work), work


def test_a_plan_splits_the_extends_rows_every_rank_computes_the_decodes_and_rank_0_samples() -> None:
    seqs = [SplitSeq(0, 10, 0), SplitSeq(10, 3, 5), SplitSeq(13, 7, 0)]  # then 2 decodes: rows 20, 21
    plans = [SplitPlan.build(seqs, rank, 2, torch.device("cpu"), decodes=2) for rank in range(2)]
    assert sorted(plans[0].perm.tolist()) == list(range(20))
    assert sorted(plans[0].rows[0] + plans[1].rows[1]) == list(range(20))
    assert all(plan.mine.tolist()[-2:] == [20, 21] for plan in plans)
    last = [9, 12, 19, 20, 21]
    assert [plans[0].mine[i].item() for i in plans[0].local_rows(last)] == last
    with pytest.raises(ValueError, match="does not compute"):
        plans[1].local_rows(last)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Causal attention of the new tokens (positions prefix..) over every key in order."""
    q_pos = torch.arange(q.shape[0]) + prefix
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=SCALE, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("prefix", "length", "size"), [(0, 37, 2), (21, 40, 2), (9, 64, 4), (0, 5, 4)])
def test_every_ranks_pieces_together_equal_causal_attention(fused: bool, prefix: int, length: int, size: int) -> None:
    gen = torch.Generator().manual_seed(prefix + length)
    q = torch.randn(length, Q_HEADS, DIM, generator=gen)
    k, v = (torch.randn(prefix + length, KV_HEADS, DIM, generator=gen) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    for rank in range(size):
        plan = SplitPlan.build([SplitSeq(0, length, prefix)], rank, size, torch.device("cpu"))
        for p in plan.pieces:
            new = slice(prefix + p.offset, prefix + p.offset + p.length)
            rows = slice(p.offset, p.offset + p.length)
            out[rows] = attend_piece(q[rows], k[: new.start], v[: new.start], k[new], v[new], SCALE, fused)
    torch.testing.assert_close(out, _reference(q, k, v, prefix), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("prefix", "length", "size"), [(0, 37, 2), (21, 40, 2), (9, 64, 4), (0, 5, 4)])
def test_pieces_attended_before_and_after_the_exchange_equal_causal_attention(prefix: int, length: int,
                                                                             size: int) -> None:
    """The CPU form of a split step: each piece over the prefix and its own keys first (``local_parts``, while
    the exchange runs), then over the step's keys before it (the exchanged rows), merged (``merge_parts``)."""
    gen = torch.Generator().manual_seed(prefix + length)
    q = torch.randn(length, Q_HEADS, DIM, generator=gen)
    k, v = (torch.randn(prefix + length, KV_HEADS, DIM, generator=gen) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    for rank in range(size):
        for p in SplitPlan.build([SplitSeq(0, length, prefix)], rank, size, torch.device("cpu")).pieces:
            rows, own = slice(p.offset, p.offset + p.length), slice(prefix + p.offset, prefix + p.offset + p.length)
            parts = local_parts(q[rows], [k[:prefix], v[:prefix]] if prefix else None, (k[own], v[own]), SCALE)
            earlier = slice(prefix, prefix + p.offset)
            late = [unmasked_cpu(q[rows], k[earlier], v[earlier], SCALE)] if p.offset else []
            out[rows] = merge_parts([*parts, *late], q.dtype)
    torch.testing.assert_close(out, _reference(q, k, v, prefix), atol=1e-5, rtol=1e-4)


def _split_steps(server: TPServer) -> float:
    return metrics.value(metrics.scrape(server.url), "tierserve_cp_split_steps_total")


def _split_decodes(server: TPServer) -> float:
    return metrics.value(metrics.scrape(server.url), "tierserve_cp_split_decodes_total")


LAYOUTS = {"cp2": (1, 2, 1), "cp4": (1, 4, 1), "tp2cp2": (2, 2, 1), "pp2cp2": (1, 2, 2)}  # (TP, CP, PP)


@pytest.fixture(scope="module")
def split_reference(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The model every layout serves, the short prompt, the 1100- and 300-token ones and the turn
    extending the first by 300, and what ``transformers`` answers to each (once for all layouts)."""
    heads, kv_heads = HEADS["llama"]
    model = add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("split") / "llama", max_position=2048,
                                               heads=heads, kv_heads=kv_heads))
    gen = torch.Generator().manual_seed(11)
    short, *asked = (torch.randint(2, 384, (n,), generator=gen).tolist() for n in (7, 1100, 300))
    turn = asked[0] + torch.randint(2, 384, (300,), generator=gen).tolist()
    asked = [short, *asked, turn]
    return model, asked, hf_greedy(model, asked)


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["cp2", *(pytest.param(name, marks=pytest.mark.slow)
                                             for name in ("cp4", "tp2cp2", "pp2cp2"))])
def test_split_steps_answer_as_transformers(layout: str, split_reference, tmp_path: Path) -> None:
    """While a short prompt decodes (its decodes join the split steps: mixed), a batch of a
    1100-token prompt (a fresh chunk, then a chunk over a prefix: both split, the rest replicated)
    and a 300-token one; then a prompt that extends the long one by 300 tokens (hits its pages: a
    split over a cached prefix). Composed with TP (each CP rank a TP pair) and PP (each stage's CP
    ranks split the same rows) too."""
    tp, cp, pp = LAYOUTS[layout]
    model, (short, *asked, turn), expected = split_reference
    server = start_server(model, tp, tmp_path / "serve.log", "--cp-size", str(cp), "--pp-size", str(pp),
                          "--chunked-prefill-size", str(CHUNK),
                          "--max-total-tokens", str(4096 // cp + 256)).wait_healthy()
    try:
        stream = server.client().completions.create(model=model.name, prompt=short, max_tokens=SHORT_DECODES,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))  # decoding from here on, for longer than the batch's prefill takes
        assert token_ids(model, complete_all(server, model, asked)) == expected[1:3], server.log.read_text()[-3000:]
        short_text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in stream)
        assert token_ids(model, [short_text])[0][: len(expected[0])] == expected[0]
        assert poll_settled(lambda: _split_decodes(server), lambda decodes: decodes > 0, DEADLINE_S) > 0
        before = poll_settled(lambda: _split_steps(server), lambda steps: steps >= 2, DEADLINE_S)
        assert token_ids(model, complete_all(server, model, [turn])) == expected[3:]
        assert poll_settled(lambda: _split_steps(server), lambda steps: steps > before, DEADLINE_S) > before
    finally:
        server.stop()


@pytest.mark.integration
def test_a_split_prefill_node_hands_every_token_once(tmp_path: Path) -> None:
    """CP 2 prefill node (chunks of ``CHUNK``: its steps split) -> TP 1 decode node: the single
    engine's answers, and the two ranks together send exactly the prompts' KV bytes (each owner its
    pages, written there by the split's exchange)."""
    model = make_tiny_model("llama", tmp_path / "llama", max_position=2048)
    gen = torch.Generator().manual_seed(13)
    batch = [torch.randint(2, 384, (n,), generator=gen).tolist() for n in (700, 300)]
    port = free_port()
    prefill_args = [*NODE_ARGS, "--chunked-prefill-size", str(CHUNK), "--cp-size", "2", "--metrics-port", str(port)]
    nodes = [NodeProcess("prefill", ["--model", str(model), *prefill_args], tmp_path / "prefill.log"),
             NodeProcess("decode", ["--model", str(model), *DECODE_ARGS], tmp_path / "decode.log")]
    try:
        prefill, decode = (node.wait_ready() for node in nodes)
        results = asyncio.run(run_all(prefill.address, decode.address, batch, "split-"))
        assert [tokens for tokens, _ in results] == reference(model, batch)
        assert [r.transferred_bytes for _, r in results] == [len(p) * TOKEN_BYTES for p in batch]
        steps = lambda: metrics.value(metrics.scrape(f"http://127.0.0.1:{port}"), "tierserve_cp_split_steps_total")  # noqa: E731
        assert poll_settled(steps, lambda n: n >= 2, DEADLINE_S) >= 2
    finally:
        for node in nodes:
            node.stop()
