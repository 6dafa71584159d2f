"""The built-in SmolLM2 model: our engine agrees with transformers on the converted folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.core.sampling import SamplingParams
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.model.attention import AttentionBatch, ExtendSpan

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def hf(builtin_model: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_model, dtype=torch.float32)
    return model, transformers.AutoTokenizer.from_pretrained(builtin_model)


@pytest.fixture(scope="module")
def engine(builtin_model: Path) -> Engine:
    return Engine(EngineConfig(builtin_model, dtype="float32", page_size=16, max_total_tokens=4096))


def _chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _our_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    pages = engine.allocator.alloc(-(-len(ids) // engine.config.page_size))
    try:
        slots = torch.tensor([pages[i // 16] * 16 + i % 16 for i in range(len(ids))])
        batch = AttentionBatch(page_size=16, out_slots=slots, extends=[ExtendSpan(0, len(ids), 0)],
                               decode_start=len(ids))
        with torch.inference_mode():
            hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), batch, engine.pool)
            return engine.model.logits(hidden)
    finally:
        engine.allocator.free(pages)


def test_logits_match_transformers(hf, engine: Engine) -> None:
    model, tokenizer = hf
    ids = _chat_ids(tokenizer, QUESTIONS[0])
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0].float()
    ours = _our_logits(engine, ids)
    assert ours.shape == expected.shape == (len(ids), 49152)
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-3)


def test_greedy_output_matches_transformers(hf, engine: Engine) -> None:
    model, tokenizer = hf
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS]
    expected = []
    for ids in prompts:
        # an explicit mask: the pad id (<|im_end|>) occurs in chat prompts and would be masked out
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert engine.generate(prompts, params) == expected


def test_capital_of_france_is_paris(hf, engine: Engine) -> None:
    _, tokenizer = hf
    engine.add_request("paris", _chat_ids(tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=24, temperature=0))
    text, last = "", None
    while engine.has_work():
        for out in engine.step():
            text += out.new_text
            last = out
    assert "Paris" in text
    assert last.finish_reason.value == "stop"  # the model ends its answer with <|im_end|>
    assert "<|im_end|>" not in text
