"""Agents end to end with the official ``openai`` client and an agent framework's own client code
(docs/agents.md, docs/structured.md), on the built-in model through ``tierserve serve`` and through
``tierserve up``: schema-valid samples, forced and parsed tool calls (streamed as deltas), the same
constrained greedy output on both paths, and a two-turn agent loop served from the prefix cache."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from helpers.processes import ServeProcess, free_port, running_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"  # the built-in model's own template knows no tools
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": PARAMS}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def serve(builtin_model: Path, tmp_path_factory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = ServeProcess(["--model", str(builtin_model), "--device", "cpu", "--max-total-tokens", "16384",
                           "--chat-template", str(TEMPLATE)], log).wait_ready()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(builtin_model: Path) -> Iterator[openai.OpenAI]:
    port = free_port()
    with running_up(port, "--model", str(builtin_model), "--no-l3", "--max-total-tokens", "8192",
                    "--chat-template", str(TEMPLATE)):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(params=["serve", "cluster"])
def client(request) -> openai.OpenAI:
    return request.getfixturevalue(request.param)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[dict[int, str], dict[int, list[dict]], dict[int, str]]:
    """A streamed chat's content, tool-call deltas and finish reason per choice."""
    content: dict[int, str] = {}
    calls: dict[int, list[dict]] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=_model(client), stream=True, **body):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            calls.setdefault(c.index, []).extend(tc.model_dump() for tc in c.delta.tool_calls or [])
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return content, calls, reasons


def test_200_sampled_json_schema_outputs_of_the_builtin_model_all_validate(serve: openai.OpenAI) -> None:
    """100 choices in one response and 100 streamed, temperature 1: every one parses and validates."""
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "response_format": FORMAT,
            "n": 100, "temperature": 1.0, "max_tokens": 48}
    whole = serve.chat.completions.create(model=_model(serve), **body)
    streamed, _, reasons = _streamed(serve, **body)
    texts = [c.message.content or "" for c in whole.choices] + list(streamed.values())
    assert len(texts) == 200
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert {c.finish_reason for c in whole.choices} == {"stop"} and set(reasons.values()) == {"stop"}


def test_through_up_samples_validate_and_greedy_equals_serve(serve: openai.OpenAI, cluster: openai.OpenAI) -> None:
    """PD: the prefill node samples the first token under the grammar, the decode node continues it."""
    body = {"messages": [{"role": "user", "content": "Describe a person as JSON."}], "response_format": FORMAT,
            "temperature": 1.0, "max_tokens": 48, "n": 6}
    sampled = cluster.chat.completions.create(model=_model(cluster), **body)
    streamed, _, _ = _streamed(cluster, **body)
    for text in [c.message.content or "" for c in sampled.choices] + list(streamed.values()):
        jsonschema.validate(json.loads(text), SCHEMA)
    for ask in ("A person from Rome, as JSON.", "Someone old, as JSON."):
        greedy = {"messages": [{"role": "user", "content": ask}], "response_format": FORMAT, "temperature": 0,
                  "max_tokens": 48}
        answers = [c.chat.completions.create(model=_model(c), **greedy).choices[0].message.content
                   for c in (serve, cluster)]
        assert answers[0] == answers[1]
        jsonschema.validate(json.loads(answers[0] or ""), SCHEMA)


def test_required_gives_valid_calls_and_streams_them(client: openai.OpenAI) -> None:
    # one call: at temperature 1 the grammar of parallel calls let a sample write several and reach max_tokens
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "max_tokens": 60}
    reply = client.chat.completions.create(model=_model(client), **body).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    for call in reply.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    _, calls, reasons = _streamed(client, **body)
    assert calls[0] and reasons[0] == "tool_calls"
    assert all(c["function"]["name"] == "get_weather" for c in calls[0])
    jsonschema.validate(json.loads(calls[0][0]["function"]["arguments"]), PARAMS)


def test_a_named_function_streams_valid_arguments_as_deltas(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, reasons = _streamed(client, messages=ASK, tools=[WEATHER], tool_choice=named, temperature=1.0,
                                  max_tokens=40)
    deltas = calls[0]
    assert deltas[0]["id"] and deltas[0]["function"]["name"] == "get_weather" and len(deltas) > 1
    jsonschema.validate(json.loads("".join(d["function"]["arguments"] or "" for d in deltas)), PARAMS)
    assert reasons[0] == "tool_calls"


def test_a_two_turn_agent_loop_is_served_from_the_first_turn_prefix(client: openai.OpenAI) -> None:
    """Call, tool result, answer: the second turn's prompt starts with the first's (system prompt,
    tools, question), which the prefix cache serves."""
    first = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(model=_model(client), messages=history, tools=[WEATHER],
                                            tool_choice="none", temperature=0, max_tokens=16)
    assert second.choices[0].message.content
    assert first.usage is not None and second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 64, (cached, first.usage.prompt_tokens)  # whole pages of it


def test_the_openai_agents_sdk_drives_a_tool_call_unchanged(serve: openai.OpenAI) -> None:
    """The ``openai-agents`` SDK's chat-completions model: its own request bodies, its own tool
    schema (strict), its own parsing of our answer; the tool runs with the arguments we decoded."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    model = OpenAIChatCompletionsModel(model=_model(serve), openai_client=openai.AsyncOpenAI(
        base_url=str(serve.base_url), api_key="none", max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(cities) == 1 and result.final_output == f"Sunny in {cities[0]}"
