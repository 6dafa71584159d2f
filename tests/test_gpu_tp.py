"""Tensor parallelism on CUDA (NCCL between the ranks, a gloo control group): run where two GPUs
exist, ``pytest -m gpu``. The same greedy outputs as ``transformers`` through the OpenAI API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tiny_models import add_word_tokenizer, make_tiny_model
from tokenizers import Tokenizer
from tp_server import HEADS, complete, descendants, hf_greedy, prompts, start_server, wait_gone

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("family", sorted(HEADS))
def test_tp2_on_cuda_equals_transformers(family: str, tmp_path: Path) -> None:
    heads, kv_heads = HEADS[family]
    model = add_word_tokenizer(make_tiny_model(family, tmp_path / family, heads=heads, kv_heads=kv_heads))
    asked = prompts()
    expected = hf_greedy(model, asked)
    server = start_server(model, 2, tmp_path / "serve.log", "--device", "cuda").wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        client = server.client()
        with ThreadPoolExecutor(len(asked)) as pool:
            texts = list(pool.map(lambda p: complete(client, model.name, p), asked))
    finally:
        server.stop()
    words = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert [words.encode(text).ids for text in texts] == expected
    assert wait_gone(ranks, 10) == []
