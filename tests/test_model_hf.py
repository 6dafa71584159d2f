"""Greedy outputs of our engine equal Hugging Face generate on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model import attention

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 40, 70)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="session")
def reference(tiny_model: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    prompts = _prompts(384)
    expected = _hf_greedy(tiny_model, prompts)
    for tokens in expected:  # a collapsed model would make the comparison meaningless
        assert len(tokens) == NEW_TOKENS and len(set(tokens)) > 8
    return tiny_model, prompts, expected


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("chunk", [2048, 7])
def test_batched_greedy_matches_hf(reference, page_size: int, chunk: int) -> None:
    model_dir, prompts, expected = reference
    engine = Engine(EngineConfig(model_dir, dtype="float32", page_size=page_size,
                                 max_total_tokens=4096, chunked_prefill_size=chunk))
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_split_extend_matches_hf(reference, monkeypatch, page_size: int) -> None:
    """Every chunk after the first attends in the split form (prefix unmasked, chunk causal, merged;
    model/attention.py), which only long chunks take by default."""
    monkeypatch.setattr(attention, "MIN_SPLIT_MASK", 0)
    model_dir, prompts, expected = reference
    engine = Engine(EngineConfig(model_dir, dtype="float32", page_size=page_size,
                                 max_total_tokens=4096, chunked_prefill_size=7))
    assert engine.generate(prompts, GREEDY) == expected


@pytest.mark.parametrize("page_size", [1, 16])
def test_one_at_a_time_matches_hf(reference, page_size: int) -> None:
    model_dir, prompts, expected = reference
    engine = Engine(EngineConfig(model_dir, dtype="float32", page_size=page_size,
                                 max_total_tokens=1024, chunked_prefill_size=16))
    for prompt, want in zip(prompts, expected, strict=True):
        assert engine.generate([prompt], GREEDY) == [want]


def test_staggered_arrivals_match_hf(reference) -> None:
    """Requests joining a running batch mid-decode (continuous batching) change nothing."""
    model_dir, prompts, expected = reference
    engine = Engine(EngineConfig(model_dir, dtype="float32", page_size=16,
                                 max_total_tokens=4096, chunked_prefill_size=24))
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        got[str(i)] = []
        for _ in range(3 + i):
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(len(prompts))] == expected
