"""``tierserve up --prefill-tp-size P --decode-tp-size D``: each role's nodes get ``--tp-size``, a size
the model or the config cannot run is refused before any child starts, and a real cluster with
different TP sizes answers through the OpenAI API exactly as the single engine does."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import reference
from helpers.processes import free_port, running_up
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

from tierserve import launch
from tierserve.cli import up as cli_up
from tierserve.cli.main import build_parser
from tierserve.launch import ClusterPlan
from tierserve.launch.plan import stages

PROMPTS = [list(range(2, 7)), list(range(30, 100)), list(range(100, 140))]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("up_tp"), heads=8, kv_heads=4, max_position=2048)
    return add_word_tokenizer(folder)


def _plan(monkeypatch, model: Path, *flags: str) -> tuple[int, list[ClusterPlan]]:
    plans: list[ClusterPlan] = []
    monkeypatch.setattr(launch, "up", lambda plan, announce: plans.append(plan) or 0)
    return cli_up.cmd_up(build_parser().parse_args(["up", "--model", str(model), *flags])), plans


def test_each_role_gets_its_tp_size(monkeypatch, model: Path) -> None:
    status, plans = _plan(monkeypatch, model, "--no-l3", "--prefill-tp-size", "2", "--decode-tp-size", "4",
                          "--prefill-args", "--handoff-timeout 9")
    assert status == 0
    by_name = {spec.name: spec.argv for stage in stages(plans[0]) for spec in stage}
    prefill = build_parser().parse_args(list(by_name["prefill-0"][3:]))  # past "python -m tierserve.cli"
    decode = build_parser().parse_args(list(by_name["decode-0"][3:]))
    assert (prefill.tp_size, decode.tp_size, prefill.handoff_timeout) == (2, 4, 9.0)
    status, plans = _plan(monkeypatch, model, "--no-l3")
    assert "--tp-size" not in [a for stage in stages(plans[0]) for spec in stage for a in spec.argv]


@pytest.mark.parametrize(("flags", "message"), [
    (["--no-l3", "--decode-tp-size", "3"], "--decode-tp-size 3: tensor-parallel size 3 does not divide"),
    (["--no-l3", "--tp-size", "2"], "--prefill-tp-size, --decode-tp-size"),
])
def test_a_tp_size_that_cannot_run_is_refused_before_any_child_starts(monkeypatch, capsys, model: Path,
                                                                      flags: list[str], message: str) -> None:
    status, plans = _plan(monkeypatch, model, *flags)
    assert status == 2 and plans == []
    assert message in capsys.readouterr().err


def _completion(port: int, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [int(word.removeprefix("w")) for word in reply.json()["choices"][0]["text"].split()]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_up_with_different_tp_sizes_answers_as_the_single_engine(model: Path, p: int, d: int) -> None:
    port = free_port()
    with running_up(port, "--model", str(model), "--no-l3", "--dtype", "float32", "--max-total-tokens", "2048",
                    "--prefill-tp-size", str(p), "--decode-tp-size", str(d)) as lines:
        assert [_completion(port, prompt) for prompt in PROMPTS] == reference(model, PROMPTS)
        assert f"at TP {max(p, d)}" in "".join(lines)
