"""Logprobs on nodes of several ranks (``serve --tp-size 2``, ``--cp-size 2``): the sampling rank
(rank 0) computes them; prompt and generated logprobs equal transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.logprob_checks import echo_completion, generated_logprobs
from helpers.rank_servers import start_server

pytestmark = pytest.mark.integration


def test_logprobs_at_tp2_equal_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama, 2, tmp_path / "serve.log").wait_healthy()
    try:
        prompt = torch.randint(2, 384, (37,), generator=torch.Generator().manual_seed(4)).tolist()
        echo_completion(server.url, tiny_llama, prompt, k=3)
        hit = generated_logprobs(server.url, tiny_llama, prompt, k=2)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
    finally:
        server.stop()


def test_logprobs_at_cp2_equal_transformers(tiny_llama: Path, tmp_path: Path) -> None:
    """Context parallelism: each rank stores half the pages; rank 0 still samples and scores."""
    server = start_server(tiny_llama, 1, tmp_path / "serve.log", "--cp-size", "2").wait_healthy()
    try:
        prompt = torch.randint(2, 384, (37,), generator=torch.Generator().manual_seed(5)).tolist()
        echo_completion(server.url, tiny_llama, prompt, k=3)
        generated_logprobs(server.url, tiny_llama, prompt, k=2)
    finally:
        server.stop()
