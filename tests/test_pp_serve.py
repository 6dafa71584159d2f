"""``tierserve serve --pp-size S`` (S pipeline stages of contiguous layers, each of ``--tp-size``
ranks, over gloo) answers greedy requests through the OpenAI API exactly as ``transformers`` does,
for Llama, Qwen2 and Qwen3 at PP 2 and TP 2 x PP 2 on 4 layers, and on 5 layers, which neither
PP 2 nor PP 3 divides (default splits 3 + 2 and 2 + 2 + 1; PP 2 also as ``--pp-layer-partition 1,4``):
several concurrent requests (one batch) and prompts longer than a prefill chunk; with HiCache on every
stage, answers served from L1 and from L2 equal those without a cache, evenly and unevenly split. More
stages than layers, and a partition that does not fit, are refused before start (status 2, on serve
and the node roles); a stage that dies takes the node down."""

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

from tierserve.core.layer_split import layer_partition, split_layers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SEED = 1  # at seed 0 the 4-layer Qwen3 repeats a few tokens, which would hide wrong answers
LAYERS = 4  # two per stage at PP 2: each stage's second layer sits at a pool index other than its id
UNEVEN = 5  # neither PP 2 nor PP 3 divides it
PAGE = 4  # tp_server's page size
L2_PROMPT_TOKENS = 88  # 22 pages: with a 48-page pool, three other prompts push the first out of L1


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, Path]:
    """Tiny Llamas by layer count."""
    return {n: add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp(f"llama{n}"), heads=8, kv_heads=4,
                                                  layers=n)) for n in (LAYERS, UNEVEN)}


@pytest.fixture(scope="module")
def model(models) -> Path:
    return models[LAYERS]


@pytest.fixture(scope="module", params=sorted(HEADS))
def reference(request, tmp_path_factory) -> dict[int, tuple[Path, list[list[int]]]]:
    """Tiny models of one family with a word tokenizer, by layer count, and what ``transformers``
    answers greedily."""
    heads, kv_heads = HEADS[request.param]
    out = {}
    for layers in (LAYERS, UNEVEN):
        model = make_tiny_model(request.param, tmp_path_factory.mktemp(f"{request.param}{layers}"), seed=SEED,
                                heads=heads, kv_heads=kv_heads, layers=layers)
        add_word_tokenizer(model)
        tokens = hf_greedy(model, prompts())
        for answer in tokens:  # a collapsed model would make the comparison meaningless
            assert len(set(answer)) > 4
        out[layers] = model, tokens
    return out


@pytest.mark.parametrize(("tp_size", "pp_size", "layers", "flags"), [
    (1, 2, LAYERS, ()), (2, 2, LAYERS, ()), (1, 2, UNEVEN, ()), (1, 3, UNEVEN, ()),
    (1, 2, UNEVEN, ("--pp-layer-partition", "1,4")),
], ids=["pp2", "tp2-pp2", "pp2-of-5", "pp3-of-5", "pp2-1+4"])
def test_greedy_outputs_equal_transformers(reference, tmp_path: Path, tp_size: int, pp_size: int, layers: int,
                                           flags: tuple[str, ...]) -> None:
    model, expected = reference[layers]
    server = start_server(model, tp_size, tmp_path / "serve.log", "--pp-size", str(pp_size), *flags).wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        texts = complete_all(server, model, prompts())
    finally:
        server.stop()
    assert token_ids(model, texts) == expected
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]
    assert wait_gone(ranks, 10) == []
    log = server.log.read_text()
    partition = layer_partition(flags[-1]) if flags else None
    last = layers - split_layers(layers, pp_size, partition)[-1]
    assert f"stage={pp_size - 1}/{pp_size} layers={last}-{layers - 1}" in log  # the ranks really were these stages


@pytest.mark.parametrize(("tp_size", "pp_size", "layers", "flags"), [
    (1, 2, LAYERS, ()), (2, 2, LAYERS, ()), (1, 3, UNEVEN, ()), (1, 2, UNEVEN, ("--pp-layer-partition", "1,4")),
], ids=["pp2", "tp2-pp2", "pp3-of-5", "pp2-1+4"])
def test_l1_and_l2_hits_answer_as_no_cache(models, tmp_path: Path, tp_size: int, pp_size: int, layers: int,
                                           flags: tuple[str, ...]) -> None:
    model = models[layers]
    gen = torch.Generator().manual_seed(11)
    asked = [torch.randint(2, 384, (L2_PROMPT_TOKENS,), generator=gen).tolist() for _ in range(4)]
    want = hf_greedy(model, asked)
    flags = ["--pp-size", str(pp_size), *flags, "--enable-hierarchical-cache", "--max-total-tokens", str(48 * PAGE)]
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


@pytest.mark.parametrize("role", ["serve", "prefill", "decode"])
def test_stages_the_layers_cannot_fill_are_refused_before_start(model: Path, role: str) -> None:
    """More stages than layers, and a partition that does not add up to them (checked against the
    model), or names another stage count (checked with the flags): status 2, nothing started."""
    done = _refusal(model, role, "--pp-size", "5")
    assert done.returncode == 2, done.stderr
    assert "--tp-size 1 --pp-size 5 does not fit" in done.stderr
    assert "pipeline-parallel size 5 is above the model's 4 layers" in done.stderr
    done = _refusal(model, role, "--pp-size", "2", "--pp-layer-partition", "2,3")
    assert done.returncode == 2, done.stderr
    assert "--pp-layer-partition 2,3 does not fit" in done.stderr and "adds up to 5 layers" in done.stderr
    done = _refusal(model, role, "--pp-size", "3", "--pp-layer-partition", "2,2")
    assert done.returncode == 2, done.stderr
    assert "the layer partition 2,2 names 2 stage(s), but the pipeline-parallel size is 3" in done.stderr
