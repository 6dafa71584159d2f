"""``tierserve up --prefill-pp-size P --decode-pp-size D``: each role's nodes get ``--pp-size``, a
size the model or the config cannot run is refused before any child starts, and a real cluster with
pipeline stages on both sides and L3 answers through the OpenAI API exactly as the single engine does."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.pd_nodes import reference
from helpers.processes import free_port, running_up
from helpers.tiny_models import add_word_tokenizer, make_tiny_model
from test_up_tp import PROMPTS, _completion, _plan

from tierserve.cli.main import build_parser
from tierserve.launch.plan import stages


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("up_pp"), heads=8, kv_heads=4, layers=4,
                             max_position=2048)
    return add_word_tokenizer(folder)


def test_each_role_gets_its_pp_size(monkeypatch, model: Path) -> None:
    status, plans = _plan(monkeypatch, model, "--no-l3", "--prefill-pp-size", "2", "--decode-pp-size", "4",
                          "--prefill-tp-size", "2")
    assert status == 0
    by_name = {spec.name: spec.argv for stage in stages(plans[0]) for spec in stage}
    prefill = build_parser().parse_args(list(by_name["prefill-0"][3:]))  # past "python -m tierserve.cli"
    decode = build_parser().parse_args(list(by_name["decode-0"][3:]))
    assert (prefill.tp_size, prefill.pp_size, decode.tp_size, decode.pp_size) == (2, 2, 1, 4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--no-l3", "--decode-pp-size", "3"], "--decode-tp-size 1 --decode-pp-size 3: pipeline-parallel size 3 "
                                           "does not divide the model's 4 layers"),
    (["--no-l3", "--pp-size", "2"], "--prefill-pp-size and --decode-pp-size"),
])
def test_a_pp_size_that_cannot_run_is_refused_before_any_child_starts(monkeypatch, capsys, model: Path,
                                                                      flags: list[str], message: str) -> None:
    status, plans = _plan(monkeypatch, model, *flags)
    assert status == 2 and plans == []
    assert message in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_up_with_stages_and_l3_answers_as_the_single_engine(model: Path) -> None:
    port = free_port()
    with running_up(port, "--model", str(model), "--dtype", "float32", "--max-total-tokens", "2048",
                    "--prefill-pp-size", "2", "--decode-pp-size", "2") as lines:
        assert [_completion(port, prompt) for prompt in PROMPTS] == reference(model, PROMPTS)
        assert "1 prefill at PP 2, 1 decode at PP 2, L3 on Mooncake" in "".join(lines)
