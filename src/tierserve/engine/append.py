"""Appends sampled tokens to a request: decides whether it finished and builds its ``RequestOutput``."""

from __future__ import annotations

import logging

from tierserve.core.outputs import TokenLogprob
from tierserve.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from tierserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class Appender:
    """Turns the tokens a step produced into outputs. A request that finishes leaves ``requests``
    and the scheduler (which gives its pages back) at once."""

    def __init__(self, eos_ids: set[int], max_model_len: int, requests: dict[str, Request],
                 scheduler: Scheduler) -> None:
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.requests = requests
        self.scheduler = scheduler

    def append_all(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None = None
                   ) -> RequestOutput:
        """Appends ``tokens`` (with their ``logprobs`` when asked) until the request finishes; one
        output for all of them. Every token after the first was fed to the model this step (a
        verified draft), so it has KV."""
        logprobs = logprobs or []
        out = self.append(request, tokens[0], logprobs[0] if logprobs else None)
        for i, token in enumerate(tokens[1:], start=1):
            if out.finished:
                break
            request.advance(1)
            more = self.append(request, token, logprobs[i] if logprobs else None)
            out.new_token_ids += more.new_token_ids
            out.new_text += more.new_text
            if more.logprobs:
                out.logprobs = (out.logprobs or []) + more.logprobs
            out.finished, out.finish_reason, out.completion_tokens = more.finished, more.finish_reason, \
                more.completion_tokens
            out.spec_draft_tokens, out.spec_accepted_tokens = more.spec_draft_tokens, more.spec_accepted_tokens
        return out

    def append(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        request.output_ids.append(token)
        if request.grammar is not None and not request.grammar.consume(token):
            log.warning("request %s: token %d breaks its structured output; it ends", request.request_id, token)
        text = request.text.push(token) if request.text is not None else ""
        reason = self._finish_reason(request, token)
        if reason is None:
            return output(request, [token], text, logprob)
        if request.text is not None:
            text += request.text.flush()
        self.requests.pop(request.request_id, None)
        self.scheduler.remove(request)
        return finish(request, reason, [token], text, logprob)

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.params
        if len(request.output_ids) < params.min_tokens:  # EOS and stop ids were masked; stop strings wait
            return FinishReason.LENGTH if request.num_tokens >= self.max_model_len else None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            return FinishReason.STOP
        if request.text is not None and request.text.stopped:
            return FinishReason.STOP
        if request.grammar is not None and request.grammar.done:  # complete: nothing may follow
            return FinishReason.STOP
        if len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def finish(request: Request, reason: FinishReason, tokens: list[int], text: str,
           logprob: TokenLogprob | None = None) -> RequestOutput:
    request.status, request.finish_reason = RequestStatus.FINISHED, reason
    return output(request, tokens, text, logprob)


def output(request: Request, tokens: list[int], text: str, logprob: TokenLogprob | None = None) -> RequestOutput:
    first = len(request.output_ids) == 1 and bool(tokens)
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=tokens,
        new_text=text,
        finished=request.status is RequestStatus.FINISHED,
        finish_reason=request.finish_reason,
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=len(request.output_ids),
        cached_tokens=request.cached_tokens,
        cached_by_tier=dict(request.cached_by_tier),
        logprobs=[logprob] if logprob is not None else None,
        prompt_logprobs=list(request.prompt_logprobs) if first and request.prompt_logprobs else None,
        spec_draft_tokens=request.spec_draft_tokens,
        spec_accepted_tokens=request.spec_accepted_tokens,
        times=request.times() if first else None,
    )
