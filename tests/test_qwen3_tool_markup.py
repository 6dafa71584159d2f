"""``tool_choice: "auto"`` parses a model's own ``<tool_call>`` markup (docs/agents.md): a tiny Qwen3 whose
greedy reply is a Hermes tool call (``helpers/tool_call_model.py``), served in process with the tools
template of ``--chat-template`` and driven by the official ``openai`` client, with no grammar anywhere.
Transformers' greedy ``generate`` on the same folder spells the same call, so the markup is what this
Qwen3 writes, not something the server forced."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from helpers.tool_call_model import CALL_TEXT, expected_reply, make_tool_call_qwen3

from tierserve.api.engine_backend import create_engine_app
from tierserve.api.tokenizer import TextTokenizer, try_load
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"  # a Qwen-style template that renders tools
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tool_call_qwen3(tmp_path_factory.mktemp("qwen3_tools"))


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> TextTokenizer:
    loaded = try_load(model, TEMPLATE)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
def client(model: Path, tokenizer: TextTokenizer) -> Iterator[openai.OpenAI]:
    loop = EngineLoop(Engine(EngineConfig(str(model), dtype="float32", page_size=16, max_total_tokens=2048))).start()
    try:
        with TestClient(create_engine_app(loop, tokenizer, "qwen3-tools")) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    finally:
        loop.stop()


def _prompt_ids(tokenizer: TextTokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(ASK, True, tools=[WEATHER]), add_special_tokens=False)


def test_transformers_and_tierserve_greedy_both_spell_the_call(model: Path, tokenizer: TextTokenizer,
                                                               client: openai.OpenAI) -> None:
    import transformers

    prompt = _prompt_ids(tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    hf_prompt = hf_tokenizer.apply_chat_template(ASK, tools=[WEATHER], chat_template=TEMPLATE.read_text(),
                                                 add_generation_prompt=True, tokenize=False)
    assert hf_tokenizer.encode(hf_prompt, add_special_tokens=False) == prompt  # the same prompt, both ways
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generated = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    assert generated.tolist() == expected_reply(model)  # the call's pieces, then EOS (<|im_end|>)
    assert tokenizer.decode(generated.tolist()) == CALL_TEXT
    ours = client.completions.create(model="qwen3-tools", prompt=prompt, max_tokens=20, temperature=0)
    assert (ours.choices[0].text, ours.choices[0].finish_reason) == (CALL_TEXT, "stop")


def test_auto_parses_the_model_own_tool_call_markup(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="qwen3-tools", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                           temperature=0, max_tokens=20)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_auto_streams_the_parsed_call_as_a_tool_call_delta(client: openai.OpenAI) -> None:
    content, deltas, reasons = "", [], []
    for chunk in client.chat.completions.create(model="qwen3-tools", messages=ASK, tools=[WEATHER], temperature=0,
                                                max_tokens=20, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (content, reasons) == ("", ["tool_calls"])  # the markup never leaks out as content
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}


def test_with_tool_choice_none_the_same_markup_is_plain_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="qwen3-tools", messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=20)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", CALL_TEXT, None)
