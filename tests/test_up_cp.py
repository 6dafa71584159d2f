"""``tierserve up --prefill-cp-size N``: prefill nodes get ``--cp-size``, decode nodes none; a size
the config cannot run is refused before any child starts; a real cluster (with L3) whose prefill
node shards its pages over two CP ranks answers through the OpenAI API exactly as the single engine."""

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
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("up_cp"), heads=8, kv_heads=4, max_position=2048)
    return add_word_tokenizer(folder)


def test_prefill_nodes_get_the_cp_size(monkeypatch, model: Path) -> None:
    status, plans = _plan(monkeypatch, model, "--no-l3", "--prefill-cp-size", "2", "--decode-tp-size", "2")
    assert status == 0
    by_name = {spec.name: spec.argv for stage in stages(plans[0]) for spec in stage}
    prefill = build_parser().parse_args(list(by_name["prefill-0"][3:]))  # past "python -m tierserve.cli"
    decode = build_parser().parse_args(list(by_name["decode-0"][3:]))
    assert (prefill.cp_size, prefill.tp_size, decode.cp_size, decode.tp_size) == (2, 1, 1, 2)


@pytest.mark.parametrize(("flags", "message"), [
    (["--cp-size", "2"], "--prefill-cp-size"),
    (["--prefill-cp-size", "2", "--prefill-tp-size", "2"],
     "--prefill-tp-size 2 --prefill-cp-size 2: --cp-size with --tp-size or --pp-size is not supported"),
    (["--no-l3", "--prefill-cp-size", "2", "--prefill-pp-size", "2"],
     "--prefill-tp-size 1 --prefill-pp-size 2 --prefill-cp-size 2: --cp-size with --tp-size or --pp-size"),
    (["--prefill-cp-size", "0"], "cp_size must be at least 1"),
])
def test_a_cp_size_that_cannot_run_is_refused_before_any_child_starts(monkeypatch, capsys, model: Path,
                                                                      flags: list[str], message: str) -> None:
    status, plans = _plan(monkeypatch, model, *flags)
    assert status == 2 and plans == []
    assert message in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_up_with_a_cp_prefill_node_answers_as_the_single_engine(model: Path) -> None:
    port = free_port()
    with running_up(port, "--model", str(model), "--dtype", "float32", "--max-total-tokens", "2048",
                    "--prefill-cp-size", "2") as lines:
        assert [_completion(port, prompt) for prompt in PROMPTS] == reference(model, PROMPTS)
        assert "1 prefill at CP 2, 1 decode, L3 on Mooncake" in "".join(lines)
