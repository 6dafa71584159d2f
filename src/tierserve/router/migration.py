"""Migration (docs/migration.md): a decode node that dies, goes silent or drains
after a request produced tokens does not end the request. The router continues it on another
pair: the prompt becomes prompt + every token produced so far (a prefill node serves most of it
from L3, where the lost decode node backed its pages up as they filled), the budgets shrink by what
was produced, and the new try's outputs are renumbered so the client sees one stream. Seeded
sampling draws from (seed, position), so the new try samples what the lost node would have."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

import grpc

from tierserve.api import openai as oa
from tierserve.core.outputs import RequestOutput
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto.trailers import DRAINING, says
from tierserve.tracing import NO_SPAN, Span

log = logging.getLogger(__name__)


class LostReason(Enum):
    FAILED = "failed"  # the stream broke (a dead node: UNAVAILABLE)
    SILENT = "silent"  # nothing for --stream-idle-timeout
    DRAINING = "draining"  # the node stops (SIGTERM) and hands its requests back


class DecodeLost(Exception):
    """A decode node stopped serving a request that already produced tokens; ``error`` is what the
    client gets when the request may not migrate again."""

    def __init__(self, address: str, reason: LostReason, error: oa.APIError) -> None:
        super().__init__(f"decode worker {address} {reason.value}: {error}")
        self.address, self.reason, self.error = address, reason, error


def draining(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a decode node ended the stream because it drains (its trailing metadata says so)."""
    return says(exc.trailing_metadata(), DRAINING)


class Resumable(Protocol):
    """The router's request as migration sees it (``backend._Request``)."""

    id: str
    prompt: list[int]
    sampling: pb.SamplingOptions
    resumed: int
    span: Span  # the request's (docs/tracing.md): a migration is a span under it


@dataclass
class Migrations:
    """Counters for ``/debug/state`` and metrics, and the recent migrations' details."""

    total: int = 0
    given_up: int = 0
    by_reason: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in LostReason})
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))

    def state(self) -> dict[str, Any]:
        return {"migrations": self.total, "migrations_given_up": self.given_up,
                "migrations_by_reason": dict(self.by_reason), "recent_migrations": list(self.recent)}


@dataclass
class _Progress:
    """What one request produced so far, across its tries."""

    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    head: RequestOutput | None = None  # the first output of all: its prompt and cache report are the request's
    tries: int = 0  # migrations so far
    resumed: dict[str, Any] | None = None  # the current try's entry in ``Migrations.recent``, until its first output
    seam: Span = NO_SPAN  # the current migration's span, from the loss to the resumed try's first output
    # speculative decoding's (drafted, accepted): an engine counts a request's from its own start, so
    # the tries before the current one are added to what the current one reports
    spec_before: tuple[int, int] = (0, 0)
    spec_now: tuple[int, int] = (0, 0)

    def record(self, out: RequestOutput) -> RequestOutput:
        """A try's output as an output of the whole request."""
        if self.resumed is not None:  # the re-prefill's cache report, for operators and the benchmark
            self.resumed |= {"cached_tokens": out.cached_tokens, "cached_by_tier": dict(out.cached_by_tier)}
            self.resumed = None
            self.seam.end()
        if self.head is None:
            self.head = out
        done = len(self.tokens)
        self.tokens += out.new_token_ids
        self.spec_now = (out.spec_draft_tokens, out.spec_accepted_tokens)
        if not self.tries:
            return out
        head, (drafted, accepted) = self.head, self.spec_before
        return replace(out, prompt_tokens=head.prompt_tokens, completion_tokens=done + len(out.new_token_ids),
                       cached_tokens=head.cached_tokens, cached_by_tier=dict(head.cached_by_tier),
                       spec_draft_tokens=drafted + out.spec_draft_tokens,
                       spec_accepted_tokens=accepted + out.spec_accepted_tokens)

    def lost_try(self) -> None:
        """The current try ended (its decode node lost): its speculative counts join the earlier tries'."""
        self.spec_before = (self.spec_before[0] + self.spec_now[0], self.spec_before[1] + self.spec_now[1])
        self.spec_now = (0, 0)


Tries = Callable[[Any], AsyncIterator[RequestOutput]]


async def migrating(tries: Tries, request: Resumable, max_migrations: int, stats: Migrations
                    ) -> AsyncIterator[RequestOutput]:
    """``tries(request)``'s outputs; when it raises ``DecodeLost``, up to ``max_migrations`` times,
    the outputs of ``tries`` of the request resumed after what it produced."""
    progress, current = _Progress(len(request.prompt)), request
    try:
        while True:
            try:
                async with contextlib.aclosing(tries(current)) as outputs:
                    async for out in outputs:
                        yield progress.record(out)
                return
            except DecodeLost as lost:
                if progress.tries >= max_migrations or len(progress.tokens) >= request.sampling.max_tokens:
                    stats.given_up += 1
                    log.warning("request %s: %s; %d migration(s) done, giving up", request.id, lost, progress.tries)
                    raise lost.error from lost
                current = resumed(request, progress.tokens, progress.tries + 1)
                _count(stats, progress, lost, request, current)
    finally:
        progress.seam.end()  # a resumed try that never produced an output


def _count(stats: Migrations, progress: _Progress, lost: DecodeLost, request: Resumable, current: Resumable) -> None:
    progress.tries += 1
    progress.lost_try()
    stats.total += 1
    stats.by_reason[lost.reason.value] += 1
    progress.resumed = {"request": request.id, "from": lost.address, "reason": lost.reason.value,
                        "generated": len(progress.tokens), "reprefill_tokens": len(current.prompt)}
    stats.recent.append(progress.resumed)
    progress.seam.end()  # a migration of a try that was itself resumed and lost before its first output
    progress.seam = request.span.child("tierserve.migration", attrs={
        "tierserve.request_id": current.id, "tierserve.migration.from": lost.address,
        "tierserve.migration.reason": lost.reason.value, "tierserve.migration.generated": len(progress.tokens),
        "tierserve.migration.reprefill_tokens": len(current.prompt)})
    log.warning("request %s: %s after %d token(s); migrating (%d of at most this many so far)", request.id,
                lost, len(progress.tokens), progress.tries)


def resumed(request: Resumable, produced: list[int], n: int) -> Any:
    """``request`` continued after ``produced``: those tokens join the prompt; ``max_tokens`` and
    ``min_tokens`` shrink by their count; prompt logprobs were sent already and are not asked again
    (asking would also keep the prefill node from reusing cached KV); a structured output's grammar
    resumes after them."""
    sampling = pb.SamplingOptions()
    sampling.CopyFrom(request.sampling)
    sampling.max_tokens = request.sampling.max_tokens - len(produced)
    sampling.min_tokens = max(0, sampling.min_tokens - len(produced))
    sampling.ClearField("prompt_logprobs")
    if sampling.HasField("constraint"):  # the grammar's state is rebuilt from them (docs/structured.md)
        sampling.constraint.resumed = request.sampling.constraint.resumed + len(produced)
    return replace(request, id=f"{request.id}-m{n}", prompt=request.prompt + produced, sampling=sampling,
                   resumed=len(produced))
