"""Response bodies and stream chunks of ``/v1/completions`` and ``/v1/chat/completions``, one id
and timestamp per response; logprobs rendered by the response's ``LogprobRenderer`` when asked."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel

from tierserve.api import openai as oa
from tierserve.api.logprobs import ChatLogprobs, LogprobRenderer
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
    """Builds one ``/v1/chat/completions`` response or its stream chunks."""

    def __init__(self, model: str, renderer: LogprobRenderer | None = None) -> None:
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.renderer = renderer

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        """OpenAI streams start with the role, and empty content, for each choice."""
        return [self._make([oa.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def chunk(self, delta: Delta) -> BaseModel:
        content = {"content": delta.text} if delta.text else {}
        return self._make([oa.ChatChunkChoice(index=delta.index, delta=content, finish_reason=delta.finish_reason,
                                              logprobs=self._logprobs(delta.entries))])

    def usage_chunk(self, usage: oa.Usage) -> BaseModel:
        return self._make([], usage)

    def response(self, choices: list[ChoiceResult], usage: oa.Usage) -> BaseModel:
        out = [oa.ChatChoice(index=c.index, message=oa.ChatMessageOut(content=c.text), finish_reason=c.finish_reason,
                             logprobs=self._logprobs(c.logprobs)) for c in choices]
        return oa.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=out, usage=usage)

    def _logprobs(self, entries: Entries | None) -> ChatLogprobs | None:
        if self.renderer is None or entries is None:
            return None
        return self.renderer.render(entries)  # type: ignore[return-value]

    def _make(self, choices: list[oa.ChatChunkChoice], usage: oa.Usage | None = None) -> oa.ChatCompletionChunk:
        return oa.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
