"""Response bodies and stream chunks of ``/v1/completions`` and ``/v1/chat/completions``, one id
and timestamp per response; logprobs rendered by the response's ``LogprobRenderer`` when asked."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tierserve.api import openai as oa
from tierserve.api.logprobs import ChatLogprobs, LogprobRenderer
from tierserve.api.tool_parsers import Reader
from tierserve.core.outputs import TokenLogprob

Entries = list[TokenLogprob | int]  # a bare id: a token without logprob (the first echoed prompt token)


@dataclass
class ChoiceResult:
    index: int
    text: str
    finish_reason: str | None
    logprobs: Entries | None = None


@dataclass
class Delta:
    """What one output adds to choice ``index``: ``text`` (after ``offset`` characters of it),
    ``entries`` (None: logprobs not asked) and the finish reason once finished."""

    index: int
    text: str
    finish_reason: str | None
    entries: Entries | None = None
    offset: int = 0


class CompletionFormat:
    """Builds one ``/v1/completions`` response or its stream chunks."""

    def __init__(self, model: str, renderer: LogprobRenderer | None = None) -> None:
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.renderer = renderer

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        return []

    def chunk(self, delta: Delta) -> BaseModel:
        return self._make([oa.CompletionChoice(index=delta.index, text=delta.text, finish_reason=delta.finish_reason,
                                               logprobs=self._logprobs(delta.entries, delta.offset))])

    def usage_chunk(self, usage: oa.Usage) -> BaseModel:
        return self._make([], usage)

    def response(self, choices: list[ChoiceResult], usage: oa.Usage) -> BaseModel:
        return self._make([oa.CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                               logprobs=self._logprobs(c.logprobs, 0)) for c in choices], usage)

    def _logprobs(self, entries: Entries | None, offset: int) -> oa.CompletionLogprobs | None:
        if self.renderer is None or entries is None:
            return None
        return self.renderer.render(entries, offset)  # type: ignore[return-value]

    def _make(self, choices: list[oa.CompletionChoice], usage: oa.Usage | None = None) -> oa.CompletionResponse:
        return oa.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


class ChatFormat:
    """Builds one ``/v1/chat/completions`` response or its stream chunks. With ``readers`` (a request
    with tools: docs/agents.md) each choice's text goes through its own tool-call reader: content and
    ``tool_calls`` deltas, and ``finish_reason: "tool_calls"`` for a choice that called tools."""

    def __init__(self, model: str, renderer: LogprobRenderer | None = None,
                 readers: Callable[[], Reader] | None = None) -> None:
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.renderer = renderer
        self.readers = readers
        self._open: dict[int, Reader] = {}

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        """OpenAI streams start with the role, and empty content, for each choice."""
        return [self._make([oa.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunk(self, delta: Delta) -> BaseModel | None:
        """The delta's chunk; None when a tool-call reader holds its text back and nothing else is new."""
        text, calls, reason = self._read(delta.index, delta.text, delta.finish_reason)
        content: dict[str, Any] = {"content": text} if text else {}
        if calls:
            content["tool_calls"] = calls
        if not content and reason is None and delta.entries is None:
            return None
        return self._make([oa.ChatChunkChoice(index=delta.index, delta=content, finish_reason=reason,
                                              logprobs=self._logprobs(delta.entries))])

    def _read(self, index: int, text: str, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        if self.readers is None:
            return text, [], reason
        reader = self._open.setdefault(index, self.readers())
        text, calls = reader.feed(text)
        if reason is not None:
            more, last = reader.finish()
            text, calls = text + more, calls + last
        return text, calls, _tool_reason(reader, reason)

    def usage_chunk(self, usage: oa.Usage) -> BaseModel:
        return self._make([], usage)

    def response(self, choices: list[ChoiceResult], usage: oa.Usage) -> BaseModel:
        out = [oa.ChatChoice(index=c.index, message=self._message(c), finish_reason=self._reason(c),
                             logprobs=self._logprobs(c.logprobs)) for c in choices]
        return oa.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=out, usage=usage)

    def _message(self, c: ChoiceResult) -> oa.ChatMessageOut:
        if self.readers is None:
            return oa.ChatMessageOut(content=c.text)
        reader = self._open[c.index] = self.readers()
        reader.feed(c.text)
        reader.finish()
        content = "".join(reader.content)
        calls = [call.message() for call in reader.calls]
        return oa.ChatMessageOut(content=None if calls and not content.strip() else content, tool_calls=calls)

    def _reason(self, c: ChoiceResult) -> str | None:
        reader = self._open.get(c.index)
        return _tool_reason(reader, c.finish_reason) if reader is not None else c.finish_reason

    def _logprobs(self, entries: Entries | None) -> ChatLogprobs | None:
        if self.renderer is None or entries is None:
            return None
        return self.renderer.render(entries)  # type: ignore[return-value]

    def _make(self, choices: list[oa.ChatChunkChoice], usage: oa.Usage | None = None) -> oa.ChatCompletionChunk:
        return oa.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


def _tool_reason(reader: Reader, reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that ended by itself having called tools."""
    return "tool_calls" if reason == "stop" and reader.calls else reason
