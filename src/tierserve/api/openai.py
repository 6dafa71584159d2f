"""The OpenAI-compatible HTTP API: request bodies, their sampling settings, response shapes, errors.

Shared by the single-engine server and the router, so it imports neither torch nor any role.
Request parsing is strict about types (``"max_tokens": "10"`` is a 400, as with OpenAI) and about
names: a field it does not know is a 400 naming it, as OpenAI answers unknown parameters, except the
fields of ``IGNORED_FIELDS`` (sent by common clients, harmless to drop) and those of
``NEUTRAL_FIELDS`` at their neutral value (docs/agents.md). ``null`` means "not given" for every
optional field, and an unknown field sent as ``null`` asks nothing, so it passes too.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tierserve.api.logprobs import ChatLogprobs, CompletionLogprobs
from tierserve.api.structured import ResponseFormat, StructuredOutputs
from tierserve.api.tools import NamedToolChoice, Tool, ToolPlan
from tierserve.core.constraint import Constraint
from tierserve.core.sampling import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from tierserve.core.tiers import TIERS

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error to return as ``{"error": {message, type, param, code}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}  # e.g. Retry-After of a 429

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "rate_limit_error" if self.status == 429 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests -------------------------------------------------------------------------------

# Fields clients send that change nothing we do: accepted and dropped on purpose.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields accepted only at the value that means "off" (anything else is a 400: we would not honour it).
NEUTRAL_FIELDS: dict[str, Any] = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "best_of": 1,
                                  "modalities": ["text"], "repetition_penalty": 1}


class UnknownFieldsError(ValueError):
    """Fields this server does not know or does not support as given."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_accepted_extras(cls, data: Any) -> Any:
        """Drops unknown fields that ask nothing (``null``, ``IGNORED_FIELDS``, neutral values)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k in cls.model_fields or not _asks_nothing(k, v)}


def _asks_nothing(name: str, value: Any) -> bool:
    return value is None or name in IGNORED_FIELDS or (name in NEUTRAL_FIELDS and value == NEUTRAL_FIELDS[name])


class StreamOptions(_Body):
    include_usage: bool | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    """An assistant turn's tool call, as the client got it from us."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # Only an assistant turn (one that called tools) may come without content, as in OpenAI's API.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role!r} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a 'tool' message needs tool_call_id")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined by newlines, tool calls' arguments
        as objects (templates render them with ``tojson``), as vLLM does."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # the template sees what the client sent


class _GenerateBody(_Body):
    """Fields shared by completions and chat; vLLM's extensions top_k, stop_token_ids, ignore_eos,
    skip_special_tokens, min_tokens, return_tokens_as_token_ids, cache_salt (a tenant: requests
    with different salts never share cached KV) and priority (an integer, lower is more important,
    default 0: ``--schedule-policy priority``) are accepted too."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    user: str | None = None
    min_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: int | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerateBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token); None: not asked."""
        return None, None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine settings; ``default_max_tokens`` applies when the body sets none.
        Raises ``InvalidRequestError`` for out-of-range values."""
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            min_tokens=self.min_tokens or 0,
            logprobs=self.logprob_counts()[0],
            prompt_logprobs=self.logprob_counts()[1],
            prompt_logprobs_start=self.logprob_start() or 1,
            constraint=self.constraint(),
            priority=self.priority or 0,
        )

    def constraint(self) -> Constraint | None:
        """The structured output asked (docs/structured.md); at most one way of asking."""
        asked = [c for c in (self.response_format, self.structured_outputs) if c is not None]
        if len(asked) > 1:
            raise InvalidRequestError("give response_format or structured_outputs, not both")
        return asked[0].constraint() if asked else None

    def logprob_start(self) -> int | None:
        return None


class CompletionRequest(_GenerateBody):
    """``logprobs``: the top alternatives (0-20) per token; with ``echo`` the prompt comes back in
    front of the text, and with both the prompt's tokens are scored too: from ``logprob_start_len``
    on (SGLang's extension; default 1, every token but the first), so the KV before it may come from
    the prefix cache."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    logprob_start_len: int | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def logprob_start(self) -> int | None:
        if self.logprob_start_len is not None and self.logprob_start_len < 0:
            raise InvalidRequestError(f"logprob_start_len must be >= 0, got {self.logprob_start_len}")
        return self.logprob_start_len

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text to tokenize or token ids to use as they are."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise InvalidRequestError("prompt must not be empty")
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class ChatCompletionRequest(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan:
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self) -> Constraint | None:
        """A structured output, or the grammar of forced tool calls (``required``, a named function)."""
        own, tools = super().constraint(), self.tool_plan().constraint()
        if own is not None and tools is not None:
            raise InvalidRequestError("tool_choice 'required' or a named function cannot be combined with a "
                                      "response_format or structured_outputs")
        return own or tools

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if not self.logprobs:
            return None, None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        return self.top_logprobs or 0, None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class TokenizeRequest(_Body):
    """``/tokenize``: either ``prompt`` text or chat ``messages`` (rendered with the chat template),
    with the ``tools`` a chat request would send, as vLLM's, so a client counts a tools request's
    prompt tokens exactly as ``/v1/chat/completions`` builds them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages, not a prompt")
        return self

    def tool_plan(self) -> ToolPlan:
        """The tools as a chat request's (no choice: they are only rendered into the prompt)."""
        return ToolPlan.of(self.tools, None, None)


BodyT = TypeVar("BodyT", bound=BaseModel)


def parse_body(cls: type[BodyT], raw: bytes) -> BodyT:
    """Validates a JSON request body; raises ``APIError`` 400 naming the first bad field."""
    try:
        return cls.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err['msg']}")
    if any(e["type"] == "extra_forbidden" for e in exc.errors(include_url=False)):
        return _unknown_fields(exc)
    loc = [str(part) for part in err["loc"]]
    if not loc:
        return APIError(400, f"invalid request body: {err['msg']}")
    if err["type"] == "missing":
        return APIError(400, f"missing required field '{'.'.join(loc)}'", param=loc[0])

    # Union members add their type names to the location; a plain sentence reads better.
    if loc[0] == "prompt":
        message = "prompt must be a string, a list of strings, a list of token ids or a list of such lists"
        return APIError(400, message, param="prompt")
    if loc[0] == "messages" and "content" in loc:
        message = f"messages[{loc[1]}].content must be a string or a list of {{'type': 'text', 'text': ...}} parts"
        return APIError(400, message, param="messages")
    return APIError(400, f"invalid value for '{'.'.join(loc)}': {err['msg']}", param=loc[0])


def _unknown_fields(exc: ValidationError) -> APIError:
    """One 400 naming every field not known (or not supported as given), where it is."""
    errors = exc.errors(include_url=False)
    names = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    shown = ", ".join(f"'{n}'" for n in names)
    return APIError(400, f"unsupported field(s) {shown}: this server does not know them or does not support them "
                         "as given (see docs/agents.md for the fields it accepts and ignores)", param=names[0])


# ---- responses ------------------------------------------------------------------------------

class CachedTokensByTier(BaseModel):
    device: int = 0
    host: int = 0
    storage: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class SpeculativeUsage(BaseModel):
    """Extension: speculative decoding's draft tokens proposed and accepted for the response."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cached_tokens_by_tier: CachedTokensByTier
    speculative: SpeculativeUsage | None = Field(default=None, exclude_if=lambda v: v is None)

    @classmethod
    def build(cls, prompt: int, completion: int, cached: int, by_tier: dict[str, int],
              speculative: SpeculativeUsage | None = None) -> Usage:
        """``speculative``: present only when draft tokens were proposed (a server with a draft model)."""
        tiers = CachedTokensByTier(**{t: by_tier.get(t, 0) for t in TIERS})
        return cls(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached), cached_tokens_by_tier=tiers,
            speculative=speculative,
        )


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and each stream chunk, as in OpenAI's API."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=lambda v: not v)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # a dict so absent keys stay absent: {} in the last chunk, as OpenAI sends
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


SSE_DONE = b"data: [DONE]\n\n"


def sse(event: BaseModel | dict[str, Any]) -> bytes:
    """One server-sent event carrying ``event`` as JSON."""
    data = event.model_dump_json().encode() if isinstance(event, BaseModel) else json.dumps(event).encode()
    return b"data: " + data + b"\n\n"
