"""``tierserve serve --tp-size N`` (N rank processes over gloo) answers greedy requests through the
OpenAI API exactly as ``transformers`` does, for Llama, Qwen2 and Qwen3 at TP 1, 2 and 4: several
concurrent requests (one batch) and prompts longer than a prefill chunk."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tiny_models import add_word_tokenizer, make_tiny_model
from tokenizers import Tokenizer
from tp_server import descendants, start_server, wait_gone

pytestmark = pytest.mark.integration

# (attention heads, KV heads): 4 and 8 KV heads split evenly; Qwen3's 2 are fewer than 4 ranks (replicated).
HEADS = {"llama": (8, 4), "qwen2": (8, 8), "qwen3": (8, 2)}
PROMPT_LENGTHS = (5, 17, 40, 70)  # the server's prefill chunk is 16 tokens
NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 384, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module", params=sorted(HEADS))
def reference(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A tiny model of one family with a word tokenizer (text answers map back to ids), its prompts
    and what ``transformers`` answers greedily."""
    heads, kv_heads = HEADS[request.param]
    model = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), heads=heads, kv_heads=kv_heads)
    add_word_tokenizer(model)
    prompts = _prompts()
    expected = _hf_greedy(model, prompts)
    for tokens in expected:  # a collapsed model would make the comparison meaningless
        assert len(set(tokens)) > 4
    return model, prompts, expected


def _complete(client, model: str, prompt: list[int]) -> str:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].text


@pytest.mark.parametrize("tp_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_outputs_equal_transformers(reference, tp_size: int, tmp_path: Path) -> None:
    model, prompts, expected = reference
    server = start_server(model, tp_size, tmp_path / "serve.log").wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        client = server.client()
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: they share steps
            texts = list(pool.map(lambda p: _complete(client, model.name, p), prompts))
    finally:
        server.stop()
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert [words.encode(text).ids for text in texts] == expected
    # SIGTERM stopped rank 0 (no SIGKILL needed), and the ranks it started left with it.
    assert server.proc.returncode == -15, server.log.read_text()[-3000:]
    assert wait_gone(ranks, 10) == []
