"""Unit tests of small pieces: allocator, rope scaling, sampler, text stream."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers import decoders as tk_decoders

from tierserve.cache.allocator import PageAccountingError, PageAllocator
from tierserve.engine.text_stream import TextStream
from tierserve.model.rope import rope_inv_freq
from tierserve.model.sampling import SamplingBatch, sample


def test_allocator_all_or_nothing_and_ownership() -> None:
    alloc = PageAllocator(8)
    a = alloc.alloc(5)
    assert len(set(a)) == 5 and alloc.num_free == 3
    assert alloc.alloc(4) is None and alloc.num_free == 3
    alloc.free(a[:2])
    with pytest.raises(PageAccountingError):
        alloc.free(a[:1])  # double free
    with pytest.raises(PageAccountingError):
        alloc.free([8])  # out of range
    alloc.check()
    alloc.free(a[2:])
    assert alloc.num_used == 0
    alloc.check()


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16,
         "mscale": 0.7, "mscale_all_dim": 0.5},
    ],
)
def test_rope_matches_transformers(scaling) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 50000.0, "rope_type": "default"} | (scaling or {})
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024,
                                   rope_parameters=params)
    ours, factor = rope_inv_freq(50000.0, 64, scaling, 1024)
    if scaling is None:
        expected = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
        theirs = 1.0
    else:
        expected, theirs = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours, expected.float())
    assert factor == pytest.approx(theirs)


def _batch(n: int, **kw) -> SamplingBatch:
    defaults = {"temperatures": [1.0] * n, "top_ps": [1.0] * n, "top_ks": [0] * n, "seeds": [None] * n,
                "positions": [0] * n}
    return SamplingBatch(**(defaults | kw))


def test_sampler_greedy_and_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    assert sample(logits, _batch(4, temperatures=[0.0] * 4)).tolist() == [1, 1, 1, 1]
    torch.manual_seed(0)
    many = logits.repeat(500, 1)
    top2 = sample(many, _batch(2000, top_ks=[2] * 2000))
    assert set(top2.tolist()) == {1, 3}
    # probabilities are ~[0.03, 0.64, 0.09, 0.24]: top_p=0.7 keeps tokens 1 and 3
    nucleus = sample(many, _batch(2000, top_ps=[0.7] * 2000))
    assert set(nucleus.tolist()) == {1, 3}
    free = sample(many, _batch(2000))
    assert set(free.tolist()) == {0, 1, 2, 3}
    share = (free == 1).float().mean().item()
    assert 0.58 < share < 0.70


def test_sampler_seeded_rows_ignore_neighbours() -> None:
    logits = torch.randn(3, 50)
    first = sample(logits, _batch(3, seeds=[5, None, None]))[0]
    torch.manual_seed(123)
    again = sample(logits, _batch(3, seeds=[5, None, None]))[0]
    assert first == again


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    """A seeded row's token is a function of (seed, position): the same pair draws the same token
    in any row, and over many positions or seeds the draws differ."""
    logits = torch.zeros(1, 1000)  # uniform: the token is the noise's argmax alone
    at = [sample(logits, _batch(1, seeds=[5], positions=[p])).item() for p in range(8)]
    assert len(set(at)) > 4
    assert sample(logits.repeat(3, 1), _batch(3, seeds=[9, 5, 5], positions=[0, 3, 3])).tolist()[1:] == [at[3]] * 2
    assert len({sample(logits, _batch(1, seeds=[s], positions=[3])).item() for s in range(8)}) > 4


@pytest.fixture(scope="module")
def char_tokenizer() -> Tokenizer:
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ,.!")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = tk_decoders.Fuse()
    return tok


def _stream(tok: Tokenizer, text: str, stop: list[str]) -> tuple[list[str], TextStream]:
    ts = TextStream(tok, stop, skip_special_tokens=True)
    pieces = []
    for tid in tok.encode(text).ids:
        pieces.append(ts.push(tid))
        if ts.stopped:
            break
    pieces.append(ts.flush())
    return pieces, ts


def test_text_stream_stops_and_holds_back(char_tokenizer: Tokenizer) -> None:
    pieces, ts = _stream(char_tokenizer, "hello world. bye", ["world."])
    assert ts.stopped and ts.text == "hello "
    assert "".join(pieces) == "hello "
    assert all("w" not in p for p in pieces)  # the partial stop string was never emitted
    pieces, ts = _stream(char_tokenizer, "say wow, ok", ["world"])
    assert not ts.stopped and "".join(pieces) == "say wow, ok"


def test_text_stream_ending_inside_a_character_gives_the_full_decode(builtin_model) -> None:
    """Generation that stops inside a multi-byte character: the final text equals
    ``tokenizer.decode(output_ids)`` (the held-back bytes as U+FFFD), as with ``transformers``."""
    tok = Tokenizer.from_file(str(builtin_model / "tokenizer.json"))
    ids = tok.encode("Hi 😀 there").ids
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:n]))  # ends inside the emoji
    ts = TextStream(tok, [], skip_special_tokens=True)
    text = "".join(ts.push(t) for t in ids[:cut]) + ts.flush()
    assert text == tok.decode(ids[:cut]) and text.endswith("\ufffd")


@pytest.mark.parametrize("seam", range(1, 12))
def test_a_primed_text_stream_continues_the_text_of_the_one_it_replaces(char_tokenizer: Tokenizer,
                                                                       seam: int) -> None:
    """A migration cuts the stream after ``seam`` tokens: what the first stream emitted plus what a
    stream primed with those tokens emits is what one stream emits, the stop string across the
    seam and the text held back at the seam included."""
    ids = char_tokenizer.encode("say wow, world. bye").ids
    whole, _ = _stream(char_tokenizer, "say wow, world. bye", ["world."])
    first = TextStream(char_tokenizer, ["world."], skip_special_tokens=True)
    before = "".join(first.push(t) for t in ids[:seam])
    second = TextStream(char_tokenizer, ["world."], skip_special_tokens=True)
    second.prime(ids[:seam])
    after = []
    for t in ids[seam:]:
        after.append(second.push(t))
        if second.stopped:
            break
    assert second.stopped and before + "".join(after) + second.flush() == "".join(whole) == "say wow, "
