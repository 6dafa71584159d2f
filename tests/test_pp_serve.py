"""``tierserve serve --pp-size S`` (S pipeline stages of contiguous layers, each of ``--tp-size``
ranks, over gloo) answers greedy requests through the OpenAI API exactly as ``transformers`` does,
for Llama, Qwen2 and Qwen3 at PP 2 and TP 2 x PP 2: several concurrent requests (one batch) and
prompts longer than a prefill chunk; with HiCache on every stage, answers served from L1 and from
L2 equal those without a cache. A PP size that does not divide the layers, and PP on a prefill
node, are refused before start; a stage that dies takes the node down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.rank_hicache import assert_hits_l1_then_l2
from helpers.rank_servers import (
    HEADS,
    complete_all,
    descendants,
    hf_greedy,
    prompts,
    rank_pids,
    start_server,
    token_ids,
    wait_exit,
    wait_gone,
)
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 1  # at seed 0 the 4-layer Qwen3 repeats a few tokens, which would hide wrong answers
LAYERS = 4  # two per stage at PP 2: each stage's second layer sits at a pool index other than its id
PAGE = 4  # tp_server's page size
L2_PROMPT_TOKENS = 88  # 22 pages: with a 48-page pool, three other prompts push the first out of L1


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    model = make_tiny_model("llama", tmp_path_factory.mktemp("llama"), heads=8, kv_heads=4, layers=LAYERS)
    return add_word_tokenizer(model)


@pytest.fixture(scope="module", params=sorted(HEADS))
def reference(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A tiny model of one family with a word tokenizer, and what ``transformers`` answers greedily."""
    heads, kv_heads = HEADS[request.param]
    model = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=SEED, heads=heads,
                            kv_heads=kv_heads, layers=LAYERS)
    add_word_tokenizer(model)
    tokens = hf_greedy(model, prompts())
    for answer in tokens:  # a collapsed model would make the comparison meaningless
        assert len(set(answer)) > 4
    return model, tokens


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 2)])
def test_greedy_outputs_equal_transformers(reference, tmp_path: Path, tp_size: int, pp_size: int) -> None:
    model, expected = reference
    server = start_server(model, tp_size, tmp_path / "serve.log", "--pp-size", str(pp_size)).wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        texts = complete_all(server, model, prompts())
    finally:
        server.stop()
    assert token_ids(model, texts) == expected
    assert server.proc.returncode == -15, server.log.read_text()[-3000:]
    assert wait_gone(ranks, 10) == []
    assert "stage=1/2" in server.log.read_text()  # the ranks really were two stages


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 2)])
def test_l1_and_l2_hits_answer_as_no_cache(model: Path, tmp_path: Path, tp_size: int, pp_size: int) -> None:
    gen = torch.Generator().manual_seed(11)
    asked = [torch.randint(2, 384, (L2_PROMPT_TOKENS,), generator=gen).tolist() for _ in range(4)]
    want = hf_greedy(model, asked)
    flags = ["--pp-size", str(pp_size), "--enable-hierarchical-cache", "--max-total-tokens", str(48 * PAGE)]
    server = start_server(model, tp_size, tmp_path / "serve.log", *flags).wait_healthy()
    try:
        assert_hits_l1_then_l2(server, model, asked, want)
    finally:
        server.stop()


def test_a_dead_last_stage_takes_the_node_down(model: Path, tmp_path: Path) -> None:
    server = start_server(model, 1, tmp_path / "serve.log", "--pp-size", "2").wait_healthy()
    try:
        (last_stage,) = rank_pids(server.proc.pid, 1)
        os.kill(last_stage, signal.SIGKILL)
        assert wait_exit(server.proc, 30) == 1
    finally:
        server.stop()
    assert "stopping the node: rank-1" in server.log.read_text()


def _refusal(model: Path, role: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tierserve.cli", role, "--model", str(model), "--port", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_pp_size_that_does_not_divide_the_layers_is_refused(model: Path) -> None:
    done = _refusal(model, "serve", "--pp-size", "3")
    assert done.returncode == 2, done.stderr
    assert "pipeline-parallel size 3 does not divide the model's 4 layers" in done.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_node_role_refuses_a_pp_size_that_does_not_divide_the_layers(model: Path, role: str) -> None:
    done = _refusal(model, role, "--pp-size", "3")
    assert done.returncode == 2, done.stderr
    assert "--tp-size 1 --pp-size 3 does not fit" in done.stderr
    assert "pipeline-parallel size 3 does not divide the model's 4 layers" in done.stderr
