"""The API's side of agents (docs/agents.md, docs/structured.md), in process over a scripted backend:
unknown fields refused by name, bad schemas, regexes, grammars and tools a 400 before any engine,
tool calls parsed out of each model family's markup, streamed as OpenAI's deltas."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.idle_backend import IdleBackend

from tierserve.api.app import create_app
from tierserve.api.metrics import ApiMetrics
from tierserve.api.tokenizer import try_load
from tierserve.core.constraint import ConstraintKind
from tierserve.core.outputs import FinishReason, RequestOutput
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import CacheScope
from tierserve.model.fetch import builtin_model_dir
from tierserve.structured import grammars

pytestmark = pytest.mark.fakes  # a scripted backend in place of an engine
TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedBackend(IdleBackend):
    """Answers every request with ``pieces`` of text, one output each; records the params it got."""

    max_model_len = 4096

    def __init__(self) -> None:
        self.pieces: list[str] = ["hello"]
        self.seen: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, scope: CacheScope,
                       *, buffered: bool = False, sibling: object = None) -> AsyncIterator[RequestOutput]:
        self.seen.append((prompt_ids, params))
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            reason = FinishReason.STOP if last else None
            yield RequestOutput(request_id, [i], piece, last, reason, len(prompt_ids), i + 1)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from tierserve.model.fetch import fetch_builtin_model

    return fetch_builtin_model(progress=False)


def _post(backend: ScriptedBackend, path: str, body: dict[str, Any], parser: str | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        tokenizer = try_load(builtin_model_dir(), TEMPLATE, parser)
        app = create_app(backend, tokenizer, "m", ApiMetrics())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)
    return asyncio.run(call())


def _chat(backend: ScriptedBackend, parser: str | None = None, **fields: Any) -> httpx.Response:
    return _post(backend, "/v1/chat/completions", {"messages": USER, **fields}, parser)


def _error(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def _events(reply: httpx.Response) -> list[dict[str, Any]]:
    lines = [ln.removeprefix("data: ") for ln in reply.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_unknown_fields_are_a_400_naming_every_one(tokenizer_dir: Path) -> None:
    error = _error(_chat(ScriptedBackend(), foo=1, guided_json={"type": "object"}))
    assert "'foo'" in error["message"] and "'guided_json'" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] in ("foo", "guided_json")
    nested = _error(_chat(ScriptedBackend(), stream=True, stream_options={"include_usage": True, "bar": 1}))
    assert "stream_options.bar" in nested["message"]
    assert "frequency_penalty" in _error(_chat(ScriptedBackend(), frequency_penalty=0.5))["message"]


def test_ignored_fields_neutral_values_and_nulls_pass(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    reply = _chat(backend, metadata={"k": "v"}, store=False, service_tier="auto", frequency_penalty=0,
                  presence_penalty=0.0, logit_bias={}, audio=None, user="u")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hello"


@pytest.mark.parametrize(("fields", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "made-up"}}}}, "format"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "grammar"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tool 'f'"),
    ({"tools": [WEATHER, WEATHER]}, "distinct"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
    ({"structured_outputs": {"regex": "(a|b)" * 60_000}}, "bytes"),
])
def test_bad_structured_and_tool_requests_are_a_400_before_any_engine(
        tokenizer_dir: Path, fields: dict[str, Any], words: str) -> None:
    backend = ScriptedBackend()
    assert words in _error(_chat(backend, **fields))["message"]
    assert backend.seen == []


def test_a_grammar_over_the_size_bound_is_a_400(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                request: pytest.FixtureRequest) -> None:
    """A schema whose grammar passes the parser's size limit (``structured/grammars.py``; lowered here
    so that a small schema passes it) is refused, never compiled."""
    monkeypatch.setitem(grammars.LIMITS, "max_grammar_size", 100)
    grammars._checked.cache_clear()  # checks under the lowered limit must neither come from nor outlive the cache
    request.addfinalizer(grammars._checked.cache_clear)
    schema = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(20)]} for i in range(20)}}
    backend = ScriptedBackend()
    error = _error(_chat(backend, response_format={"type": "json_schema", "json_schema": {"name": "big",
                                                                                       "schema": schema}}))
    assert "too big" in error["message"] and backend.seen == []


def test_response_format_and_structured_outputs_reach_the_engine_as_constraints(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _chat(backend, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                            "strict": True}})
    _chat(backend, response_format={"type": "json_object"})
    _chat(backend, response_format={"type": "text"})
    _post(backend, "/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}})
    got = [p.constraint for _, p in backend.seen]
    assert got[0] is not None and got[0].kind is ConstraintKind.JSON_SCHEMA and got[0].strict
    assert json.loads(got[0].spec) == schema
    assert got[1] is not None and json.loads(got[1].spec) == {"type": "object"}
    assert got[2] is None
    assert got[3] is not None and got[3].kind is ConstraintKind.CHOICE and json.loads(got[3].spec) == ["yes", "no"]


def test_tools_reach_the_template_and_history_renders_tool_turns(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"}]
    assert _post(backend, "/v1/chat/completions", {"messages": history, "tools": [WEATHER]}).status_code == 200
    tokenizer = try_load(builtin_model_dir(), TEMPLATE)
    assert tokenizer is not None
    prompt = tokenizer.decode(backend.seen[0][0], skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the tool list
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt  # the call, arguments as an object
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt


def test_tokenize_counts_a_tools_request_as_chat_builds_its_prompt(tokenizer_dir: Path) -> None:
    """``/tokenize`` takes chat ``tools`` (as vLLM's): its tokens are the prompt the chat request sends."""
    backend = ScriptedBackend()
    assert _chat(backend, tools=[WEATHER]).status_code == 200
    counted = _post(backend, "/tokenize", {"messages": USER, "tools": [WEATHER]}).json()
    plain = _post(backend, "/tokenize", {"messages": USER}).json()
    assert counted["tokens"] == backend.seen[0][0] and counted["count"] > plain["count"]
    assert "tools" in _error(_post(backend, "/tokenize", {"prompt": "hi", "tools": [WEATHER]}))["message"]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert "'f'" in _error(_post(backend, "/tokenize", {"messages": USER, "tools": [bad]}))["message"]


def test_auto_parses_hermes_markup_with_content_around_it(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ["Let me check.", "\n<tool", '_call>\n{"name": "get_weather", "arg', 'uments": {"city": "Paris"}}',
                      "\n</tool_call>"]
    message = _chat(backend, tools=[WEATHER]).json()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    call = message["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert message["message"]["content"].strip() == "Let me check."
    events = _events(_chat(backend, tools=[WEATHER], stream=True))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me check."
    assert not any("<tool" in d.get("content", "") for d in deltas)  # the tag is held back, never sent as text
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_without_markup_is_plain_content_and_bad_markup_stays_text(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ["It is ", "sunny."]
    choice = _chat(backend, tools=[WEATHER]).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."} and choice["finish_reason"] == "stop"
    backend.pieces = ["<tool_call>not json</tool_call>"]
    choice = _chat(backend, tools=[WEATHER]).json()["choices"][0]
    assert choice["message"]["content"] == "<tool_call>not json</tool_call>" and choice["finish_reason"] == "stop"


def test_llama3_json_parser_reads_bare_calls(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ['{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}; ',
                      '{"name": "get_weather", "parameters": {"city": "Rome"}}']
    choice = _chat(backend, parser="llama3_json", tools=[WEATHER]).json()["choices"][0]
    cities = [json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]]
    assert cities == ["Oslo", "Rome"] and choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"


def test_required_decodes_a_call_list_and_streams_each_call_as_it_closes(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ['[{"name": "get_weather", "parameters": {"city": "a}b\\""}}', ', {"name": "get_weather", ',
                      '"parameters": {"city": "Rome"}}]']
    events = _events(_chat(backend, tools=[WEATHER], tool_choice="required", stream=True))
    constraint = backend.seen[0][1].constraint
    assert constraint is not None and json.loads(constraint.spec)["minItems"] == 1
    per_chunk = [[tc for c in e["choices"] for tc in c["delta"].get("tool_calls", [])] for e in events]
    assert [len(calls) for calls in per_chunk if calls] == [1, 1]  # one call per closed object, as it closed
    calls = [tc for calls in per_chunk for tc in calls]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in calls] == ['a}b"', "Rome"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    _chat(backend, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    constraint = backend.seen[-1][1].constraint
    assert constraint is not None and json.loads(constraint.spec)["maxItems"] == 1


def test_a_named_function_streams_its_arguments_as_fragments(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ['{"city": ', '"Paris"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    events = _events(_chat(backend, tools=[WEATHER], tool_choice=named, stream=True))
    constraint = backend.seen[0][1].constraint
    assert constraint is not None and json.loads(constraint.spec) == WEATHER["function"]["parameters"]
    calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    assert all("id" not in tc for tc in calls[1:])
    whole = _chat(backend, tools=[WEATHER], tool_choice=named).json()["choices"][0]
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert whole["finish_reason"] == "tool_calls"


def test_tool_choice_none_keeps_tools_in_the_prompt_but_parses_nothing(tokenizer_dir: Path) -> None:
    backend = ScriptedBackend()
    backend.pieces = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    choice = _chat(backend, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == backend.pieces[0] and choice["finish_reason"] == "stop"
    assert backend.seen[0][1].constraint is None


def test_the_cli_offers_every_tool_call_parser() -> None:
    from tierserve.api.tool_parsers import ToolParserKind
    from tierserve.cli.flags import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == {k.value for k in ToolParserKind}


def test_up_hands_its_chat_flags_to_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.up_plans import capture_plans, child_args, children, run_up

    plans = capture_plans(monkeypatch)
    assert run_up("--chat-template", str(TEMPLATE), "--tool-call-parser", "llama3_json", "--no-l3") == 0
    router = child_args(children(plans[0])["router"])
    assert router.chat_template == TEMPLATE.resolve() and router.tool_call_parser == "llama3_json"
