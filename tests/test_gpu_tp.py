"""Tensor parallelism on CUDA (NCCL between the ranks, a gloo control group): run where two GPUs
exist, ``pytest -m gpu``. The same greedy outputs as ``transformers`` through the OpenAI API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.rank_servers import HEADS, complete, descendants, hf_greedy, prompts, start_server, wait_gone
from helpers.tiny_models import add_word_tokenizer, make_tiny_model
from tokenizers import Tokenizer

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


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_pd_across_tp_sizes_on_cuda_equals_the_single_engine(p: int, d: int, tmp_path: Path) -> None:
    """Each rank's arena is GPU memory behind its own transfer engine: the handoff between TP sizes
    writes head sub-ranges GPU to GPU and the answers equal the single engine's."""
    from helpers.pd_nodes import CHUNK, PAGE, reference, run_pair

    model = make_tiny_model("llama", tmp_path / "llama", heads=8, kv_heads=4, max_position=2048)
    args = ["--model", str(model), "--device", "cuda", "--dtype", "float32", "--page-size", str(PAGE),
            "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096"]
    batch, got = run_pair([*args, "--tp-size", str(p)], [*args, "--tp-size", str(d)],
                          (tmp_path / "p.log", tmp_path / "d.log"), 5, "gpu-tp-")
    assert [tokens for tokens, _ in got] == reference(model, batch)
    assert [r.transferred_bytes for _, r in got] == [len(q) * 2 * 2 * 4 * 16 * 4 for q in batch]
