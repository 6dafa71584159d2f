"""A request's state inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from tierserve.cache.base import PrefixHit
from tierserve.cache.prefetch import PrefetchTicket
from tierserve.core.outputs import FinishReason, RequestOutput, RequestTimes, TokenLogprob
from tierserve.core.sampling import SamplingParams
from tierserve.core.scope import NO_SCOPE, CacheScope
from tierserve.engine.handoff import Handoff
from tierserve.engine.text_stream import TextStream
from tierserve.structured.state import GrammarState

__all__ = ["FinishReason", "Request", "RequestOutput", "RequestStatus"]


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation: prompt, output so far, page table and how much of it holds valid KV.

    ``num_computed`` tokens of ``prompt_ids + output_ids`` have KV in ``pages``; the rest (all of
    the prompt at first, then the last sampled token) is fed to the model next. After a
    preemption ``num_computed`` drops to 0 and prompt plus output are recomputed.

    With ``params.prompt_logprobs``, prompt positions from ``prompt_logprobs_next`` on still need
    their logprob, so their KV must be computed here, not taken from the cache
    (``cacheable_prefix``); the sampling rank collects the values in ``prompt_logprobs``.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    hit: PrefixHit = field(default_factory=PrefixHit)
    prefetch: PrefetchTicket | None = None  # the prefix cache's ticket until admission
    scope: CacheScope = NO_SCOPE  # requests of different scopes (tenant, cache_salt) never share cached KV
    l3_pending: int = 0  # leading prompt pages another node is writing to L3 now (the router's word, docs/cache.md)
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    cached_at_arrival: int = 0  # prompt tokens the cache held when it arrived (its prefill backlog's estimate)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    text: TextStream | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    queued_s: float | None = None  # arrival to first admission (``Scheduler._count_queued``); None before
    # traces (docs/tracing.md): the first admission, when its prefetch allowed it, when that prefetch began
    admitted_at: float | None = None
    ready_at: float | None = None
    prefetch_at: float | None = None
    handoff: Handoff | None = None  # where the prompt's KV goes as it is computed (prefill role)
    draft_computed: int = 0  # speculative decoding: tokens with KV in the draft's pool (same pages)
    spec_draft_tokens: int = 0  # draft tokens proposed for this request, and accepted
    spec_accepted_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_next: int = 0  # set from params: 1, or the prompt length when none are asked
    held_steps: int = 0  # steps it waited for a prefix another request was computing (``Scheduler._held``)
    banned: tuple[int, ...] = ()  # EOS and stop ids, never sampled before params.min_tokens
    grammar: GrammarState | None = None  # params.constraint's state (docs/structured.md)

    def __post_init__(self) -> None:
        wanted = self.params.prompt_logprobs is not None
        start = min(max(1, self.params.prompt_logprobs_start), len(self.prompt_ids))  # token 0 has no logprob
        self.prompt_logprobs_next = start if wanted else len(self.prompt_ids)
        self.prompt_logprobs = [None] * start if wanted else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids()[start:end]`` without copying the whole sequence when decoding."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.token_ids()[start:end]

    def tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    def cacheable_prefix(self) -> int:
        """Tokens the prefix cache may serve: all but the last (its logits pick the next token), and
        none from the position whose logits the first missing prompt logprob needs."""
        return min(self.num_tokens - 1, self.prompt_logprobs_next - 1)

    def advance(self, n: int) -> None:
        """``n`` more tokens have KV: the prompt logprobs they give are known."""
        self.num_computed += n
        last = len(self.prompt_ids) - 1
        if self.prompt_logprobs_next <= last:
            self.prompt_logprobs_next = max(self.prompt_logprobs_next, min(self.num_computed, last) + 1)

    def times(self) -> RequestTimes:
        """Its milestones so far; the first token's is now unless it was stamped (``first_token_at``)."""
        return RequestTimes(self.arrival, self.first_token_at or time.monotonic(), self.admitted_at, self.ready_at,
                            self.prefetch_at)

    def banned_now(self) -> list[int]:
        """Token ids this request must not sample next."""
        return list(self.banned) if self.banned and len(self.output_ids) < self.params.min_tokens else []
