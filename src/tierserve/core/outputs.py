"""What the engine reports about a request (torch-free: the HTTP layer and the router use it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed midway: ends an API stream that cannot go on (engines never report it)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's float32 log-probability under the model's raw distribution (log-softmax of the
    logits, before temperature and filters: vLLM's default ``raw_logprobs``), with the ``top``
    alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestTimes:
    """When a request reached each step inside an engine (``time.monotonic()`` seconds), for traces
    (docs/tracing.md): ``arrival`` (added; on a decode node, reserved), ``prefetch`` (its L3 prefetch
    began; None: it had none), ``ready`` (the prefetch let it be admitted), ``admitted`` (first
    scheduled, its prefix matched; None: it never was, as a reservation whose prompt came computed),
    ``first_token``."""

    arrival: float
    first_token: float
    admitted: float | None = None
    ready: float | None = None
    prefetch: float | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new tokens and text, and the final state.

    ``cached_tokens`` counts prompt tokens served from the prefix cache at admission, split by
    tier in ``cached_by_tier``. ``logprobs`` has one entry per new token when the request asked
    for them; ``prompt_logprobs`` one per prompt token (None for the first), in the first output only.
    With speculative decoding, ``spec_draft_tokens`` draft tokens were proposed for the request so
    far and ``spec_accepted_tokens`` of them accepted. ``times``: the engine's milestones, on the
    output of the first token only.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    times: RequestTimes | None = field(default=None, compare=False)  # not what the request answered

    @property
    def reason(self) -> str | None:
        """The finish reason as the OpenAI API spells it, or None while running."""
        return self.finish_reason.value if self.finish_reason is not None else None
