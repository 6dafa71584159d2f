"""``tierserve up`` with multi-rank nodes: a real cluster whose prefill and decode nodes run
different TP sizes, a CP prefill node with a TP 2 x CP 2 decode node (with L3), pipeline stages on
both sides with a PP 2 x CP 2 decode node (with L3), or a TP 2 x CP 2 prefill node with a CP 2 decode
node on a tiny Qwen3 (with L3; each prefill rank holds one KV head, each decode rank both, so the
handoff goes through the CP decode ranks' receive staging; answers equal to ``transformers``) answers
through the OpenAI API exactly as the single engine does, and says its layout in its banner. Its
plans (the sizes each role gets, the sizes refused) are in ``test_up_plan.py``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers.pd_nodes import reference
from helpers.processes import free_port, running_up
from helpers.rank_servers import hf_greedy
from helpers.tiny_models import add_word_tokenizer, make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = [list(range(2, 7)), list(range(30, 100)), list(range(100, 140))]


@pytest.fixture(scope="module")
def ranks_qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 that splits over TP 2 x CP 2 (8 heads, 2 KV heads: one per tensor rank), 2048
    positions, with the word tokenizer."""
    return add_word_tokenizer(make_tiny_model("qwen3", tmp_path_factory.mktemp("ranks_qwen3"), heads=8, kv_heads=2,
                                              max_position=2048))


def _completion(port: int, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return [int(word.removeprefix("w")) for word in reply.json()["choices"][0]["text"].split()]


@pytest.mark.parametrize(("layout", "flags", "banner"), [
    ("tp", ["--no-l3", "--prefill-tp-size", "2", "--decode-tp-size", "1"], "at TP 2"),
    ("tp", ["--no-l3", "--prefill-tp-size", "1", "--decode-tp-size", "2"], "at TP 2"),
    ("cp", ["--prefill-cp-size", "2", "--decode-tp-size", "2", "--decode-cp-size", "2"],
     "1 prefill at CP 2, 1 decode at TP 2 x CP 2, L3 on Mooncake"),
    ("pp", ["--prefill-pp-size", "2", "--decode-pp-size", "2", "--decode-cp-size", "2"],
     "1 prefill at PP 2, 1 decode at PP 2 x CP 2, L3 on Mooncake"),
    ("hf", ["--prefill-tp-size", "2", "--prefill-cp-size", "2", "--decode-cp-size", "2"],
     "1 prefill at TP 2 x CP 2, 1 decode at CP 2, L3 on Mooncake"),
], ids=["tp2-tp1", "tp1-tp2", "cp2-tp2cp2-l3", "pp2-pp2cp2-l3", "qwen3-tp2cp2-cp2-l3"])
def test_up_with_multi_rank_nodes_answers_as_the_single_engine(request, layout: str, flags: list[str],
                                                               banner: str) -> None:
    model = request.getfixturevalue({"pp": "ranks_llama4", "hf": "ranks_qwen3"}.get(layout, "ranks_llama"))
    port = free_port()
    with running_up(port, "--model", str(model), "--dtype", "float32", "--max-total-tokens", "2048", *flags) as lines:
        expected = [h[:12] for h in hf_greedy(model, PROMPTS)] if layout == "hf" else reference(model, PROMPTS)
        assert [_completion(port, prompt) for prompt in PROMPTS] == expected
        assert banner in "".join(lines)
