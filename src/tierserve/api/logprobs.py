"""Logprobs in the OpenAI response shapes (docs/cli.md).

``/v1/completions`` gives parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``), the first echoed prompt token with nulls; ``/v1/chat/completions`` gives
``{"content": [{token, logprob, bytes, top_logprobs}]}``. ``-inf`` becomes -9999.0, as vLLM sends it
(JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel

from tierserve.api.tokenizer import TextTokenizer
from tierserve.core.outputs import TokenLogprob

FLOOR = -9999.0


class LogprobShape(Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


@dataclass(frozen=True)
class LogprobRenderer:
    """Renders engine logprobs for one response: its ``shape``, ``top`` alternatives per token, and
    token strings from ``tokenizer`` or, with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) or
    no tokenizer, ``"token_id:<id>"``."""

    shape: LogprobShape
    top: int
    tokenizer: TextTokenizer | None
    as_ids: bool = False

    def token(self, token_id: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render(self, entries: list[TokenLogprob | int], offset: int = 0) -> CompletionLogprobs | ChatLogprobs:
        """``entries`` in order; a bare token id is a token without a logprob (the first echoed
        prompt token). ``offset``: the text length before them in the choice's text (``text_offset``)."""
        if self.shape is LogprobShape.CHAT:
            return ChatLogprobs(content=[self._chat(e) for e in entries if isinstance(e, TokenLogprob)])
        return self._completion(entries, offset)

    def _completion(self, entries: list[TokenLogprob | int], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for e in entries:
            scored = isinstance(e, TokenLogprob)
            token = self.token(e.token_id if scored else e)
            out.tokens.append(token)
            out.token_logprobs.append(_finite(e.logprob) if scored else None)
            out.top_logprobs.append(self._top_dict(e) if scored else None)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _top_dict(self, e: TokenLogprob) -> dict[str, float]:
        """The chosen token and the top alternatives (OpenAI: up to ``logprobs`` + 1 entries)."""
        top = {self.token(e.token_id): _finite(e.logprob)}
        for token_id, logprob in e.top[: self.top]:
            top.setdefault(self.token(token_id), _finite(logprob))
        return top

    def _chat(self, e: TokenLogprob) -> ChatTokenLogprob:
        token = self.token(e.token_id)
        top = [self._alt(t, lp) for t, lp in e.top[: self.top]]
        return ChatTokenLogprob(token=token, logprob=_finite(e.logprob), bytes=_bytes(token), top_logprobs=top)

    def _alt(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token(token_id)
        return TopLogprob(token=token, logprob=_finite(logprob), bytes=_bytes(token))


def _finite(value: float) -> float:
    return max(value, FLOOR)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
