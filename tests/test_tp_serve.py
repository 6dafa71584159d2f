"""``tierserve serve --tp-size N`` (N rank processes over gloo) answers greedy requests through the
OpenAI API exactly as ``transformers`` does, for Llama, Qwen2 and Qwen3 at TP 1, 2 and 4: several
concurrent requests (one batch) and prompts longer than a prefill chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.rank_servers import (
    HEADS,
    complete_all,
    descendants,
    hf_greedy,
    prompts,
    start_server,
    token_ids,
    wait_gone,
)
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=sorted(HEADS))
def reference(request, tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A tiny model of one family with a word tokenizer (text answers map back to ids), its prompts
    and what ``transformers`` answers greedily."""
    heads, kv_heads = HEADS[request.param]
    model = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), heads=heads, kv_heads=kv_heads)
    add_word_tokenizer(model)
    asked = prompts()
    expected = hf_greedy(model, asked)
    for tokens in expected:  # a collapsed model would make the comparison meaningless
        assert len(set(tokens)) > 4
    return model, asked, expected


@pytest.mark.parametrize("tp_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_outputs_equal_transformers(reference, tp_size: int, tmp_path: Path) -> None:
    model, asked, expected = reference
    server = start_server(model, tp_size, tmp_path / "serve.log").wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        texts = complete_all(server, model, asked)
    finally:
        server.stop()
    assert token_ids(model, texts) == expected
    # SIGTERM stopped rank 0 cleanly (no SIGKILL needed: status 0), and the ranks it started left with it.
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]
    assert wait_gone(ranks, 10) == []
