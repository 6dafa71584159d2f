"""``tierserve serve --pp-size S`` (S pipeline stages of contiguous layers, each of ``--tp-size``
ranks, over gloo) answers greedy requests through the OpenAI API exactly as ``transformers`` does,
for Llama, Qwen2 and Qwen3 at PP 2 and TP 2 x PP 2 on 4 layers, and for Llama on 5 layers, which
neither PP 2 nor PP 3 divides (default splits 3 + 2 and 2 + 2 + 1; PP 2 also as
``--pp-layer-partition 1,4``; which layers a stage holds does not depend on the family, whose layers
the even cases load at other pool indexes already): several concurrent requests (one batch) and
prompts longer than a prefill chunk; with HiCache on every stage, answers served from L1 and from L2
equal those without a cache, evenly and unevenly split. More stages than layers, and a partition that
does not fit, are refused before start (status 2, on serve and the node roles; checked in this
process, torch already loaded, and once as a process); a stage that dies takes the node down."""

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

from tierserve.cli.main import main
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


def _reference(family: str, layers: int, folder: Path) -> tuple[Path, list[list[int]]]:
    """A tiny model of ``family`` with a word tokenizer, and what ``transformers`` answers greedily."""
    heads, kv_heads = HEADS[family]
    model = add_word_tokenizer(make_tiny_model(family, folder, seed=SEED, heads=heads, kv_heads=kv_heads,
                                               layers=layers))
    tokens = hf_greedy(model, prompts())
    for answer in tokens:  # a collapsed model would make the comparison meaningless
        assert len(set(answer)) > 4
    return model, tokens


@pytest.fixture(scope="module", params=sorted(HEADS))
def reference(request, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """One family's ``LAYERS``-layer model and its ``transformers`` answers."""
    return _reference(request.param, LAYERS, tmp_path_factory.mktemp(f"{request.param}{LAYERS}"))


@pytest.fixture(scope="module")
def uneven_reference(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The ``UNEVEN``-layer Llama and its ``transformers`` answers."""
    return _reference("llama", UNEVEN, tmp_path_factory.mktemp(f"llama{UNEVEN}"))


def _check_greedy(model: Path, expected: list[list[int]], log: Path, tp_size: int, pp_size: int, layers: int,
                  flags: tuple[str, ...]) -> None:
    """One node of this layout answers the batch as ``transformers``, stops on SIGTERM with every rank,
    and its last rank logged the stage and layers it held."""
    server = start_server(model, tp_size, log, "--pp-size", str(pp_size), *flags).wait_healthy()
    ranks = descendants(server.proc.pid)
    try:
        texts = complete_all(server, model, prompts())
    finally:
        server.stop()
    assert token_ids(model, texts) == expected
    assert server.proc.returncode == 0, server.log.read_text()[-3000:]
    assert wait_gone(ranks, 10) == []
    partition = layer_partition(flags[-1]) if flags else None
    last = layers - split_layers(layers, pp_size, partition)[-1]
    assert f"stage={pp_size - 1}/{pp_size} layers={last}-{layers - 1}" in log.read_text()  # really these stages


@pytest.mark.parametrize(("tp_size", "pp_size"), [(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def test_greedy_outputs_equal_transformers(reference, tmp_path: Path, tp_size: int, pp_size: int) -> None:
    model, expected = reference
    _check_greedy(model, expected, tmp_path / "serve.log", tp_size, pp_size, LAYERS, ())


@pytest.mark.parametrize(("pp_size", "flags"), [(2, ()), (3, ()), (2, ("--pp-layer-partition", "1,4"))],
                         ids=["pp2-of-5", "pp3-of-5", "pp2-1+4"])
def test_uneven_stages_answer_as_transformers(uneven_reference, tmp_path: Path, pp_size: int,
                                              flags: tuple[str, ...]) -> None:
    model, expected = uneven_reference
    _check_greedy(model, expected, tmp_path / "serve.log", 1, pp_size, UNEVEN, flags)


@pytest.fixture(scope="module")
def l2_prompts(models) -> dict[int, tuple[list[list[int]], list[list[int]]]]:
    """Four ``L2_PROMPT_TOKENS``-token prompts and what ``transformers`` answers, by layer count."""
    gen = torch.Generator().manual_seed(11)
    asked = [torch.randint(2, 384, (L2_PROMPT_TOKENS,), generator=gen).tolist() for _ in range(4)]
    return {layers: (asked, hf_greedy(model, asked)) for layers, model in models.items()}


@pytest.mark.parametrize(("tp_size", "pp_size", "layers", "flags"), [
    (1, 2, LAYERS, ()), (2, 2, LAYERS, ()), (1, 3, UNEVEN, ()), (1, 2, UNEVEN, ("--pp-layer-partition", "1,4")),
], ids=["pp2", "tp2-pp2", "pp3-of-5", "pp2-1+4"])
def test_l1_and_l2_hits_answer_as_no_cache(models, l2_prompts, tmp_path: Path, tp_size: int, pp_size: int,
                                           layers: int, flags: tuple[str, ...]) -> None:
    model = models[layers]
    asked, want = l2_prompts[layers]
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


def _refusal(model: Path, role: str, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str]:
    """``tierserve ROLE`` run in this process, its status and stderr: torch is loaded here already,
    where each process would spend seconds importing it before refusing."""
    try:
        status = main([role, "--model", str(model), "--port", "0", *flags])
    except SystemExit as exit_:  # the node roles refuse inside run_node
        status = exit_.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("role", ["serve", "prefill", "decode"])
def test_stages_the_layers_cannot_fill_are_refused_before_start(model: Path, role: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """More stages than layers, and a partition that does not add up to them (checked against the
    model), or names another stage count (checked with the flags): status 2, nothing started."""
    status, err = _refusal(model, role, capsys, "--pp-size", "5")
    assert status == 2, err
    assert "--tp-size 1 --pp-size 5 does not fit" in err
    assert "pipeline-parallel size 5 is above the model's 4 layers" in err
    status, err = _refusal(model, role, capsys, "--pp-size", "2", "--pp-layer-partition", "2,3")
    assert status == 2, err
    assert "--pp-layer-partition 2,3 does not fit" in err and "adds up to 5 layers" in err
    status, err = _refusal(model, role, capsys, "--pp-size", "3", "--pp-layer-partition", "2,2")
    assert status == 2, err
    assert "the layer partition 2,2 names 2 stage(s), but the pipeline-parallel size is 3" in err


def test_a_refusal_is_the_exit_status_of_the_process(model: Path) -> None:
    """What the in-process refusals return is what the command's process exits with."""
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--model", str(model), "--port", "0", "--pp-size", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pipeline-parallel size 5 is above the model's 4 layers" in done.stderr
