"""The router's migration loop (``router.migration.migrating``) over scripted tries: what the client
sees of a request that lost its decode node. Unit tests: each try is an async generator standing in
for a prefill/decode pair (real pairs: ``test_migration.py``, ``test_speculative_migration.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from tierserve.api import openai as oa
from tierserve.core.outputs import RequestOutput
from tierserve.proto import tierserve_pb2 as pb
from tierserve.router.migration import DecodeLost, LostReason, Migrations, migrating
from tierserve.tracing import NO_SPAN, Span

pytestmark = pytest.mark.fakes  # scripted tries stand in for prefill/decode pairs


@dataclass
class Asked:
    """The router's request as migration sees it (``migration.Resumable``)."""

    id: str
    prompt: list[int]
    sampling: pb.SamplingOptions
    resumed: int = 0
    span: Span = NO_SPAN


def step(tokens: list[int], drafted: int, accepted: int, finished: bool = False) -> RequestOutput:
    """One step's output; the speculative counts are the try's so far, as an engine reports them."""
    return RequestOutput("r", tokens, "", finished, None, 4, 0, spec_draft_tokens=drafted,
                         spec_accepted_tokens=accepted)


def scripted(tries: list[list[RequestOutput]]) -> Callable[[Asked], AsyncIterator[RequestOutput]]:
    """Each try yields its outputs; every try but the last then loses its decode node."""
    asked: list[Asked] = []

    async def run(request: Asked) -> AsyncIterator[RequestOutput]:
        outputs = tries[len(asked)]
        asked.append(request)
        for out in outputs:
            yield out
        if len(asked) < len(tries):
            raise DecodeLost("d:1", LostReason.FAILED, oa.APIError(502, "lost"))

    return run


def collect(tries: list[list[RequestOutput]]) -> list[RequestOutput]:
    async def drain() -> list[RequestOutput]:
        request = Asked("r", [1, 2, 3, 4], pb.SamplingOptions(max_tokens=20))
        return [out async for out in migrating(scripted(tries), request, 2, Migrations())]

    return asyncio.run(drain())


def test_speculative_counts_add_up_across_migrations() -> None:
    """Draft tokens proposed and accepted before a seam stay counted after it: the last output
    reports every try's, as ``usage.speculative`` of one uninterrupted request would."""
    first = [step([5], 0, 0), step([6, 7, 8], 3, 2), step([9, 10], 6, 3)]
    second = [step([11], 0, 0), step([12, 13, 14, 15], 3, 3)]
    third = [step([16], 0, 0), step([17, 18], 3, 1, finished=True)]
    outs = collect([first, second, third])
    assert [t for o in outs for t in o.new_token_ids] == list(range(5, 19))
    last = outs[-1]
    assert (last.spec_draft_tokens, last.spec_accepted_tokens) == (6 + 3 + 3, 3 + 3 + 1)
    assert (outs[4].spec_draft_tokens, outs[4].spec_accepted_tokens) == (6 + 3, 3 + 3)
    assert last.completion_tokens == 14


def test_a_request_that_never_migrates_reports_its_own_counts() -> None:
    outs = collect([[step([5], 0, 0), step([6, 7], 2, 1, finished=True)]])
    assert (outs[-1].spec_draft_tokens, outs[-1].spec_accepted_tokens) == (2, 1)
