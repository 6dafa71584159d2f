"""An engine's part of a request, recorded after the fact from the times the engine stamped on
its first output (``RequestTimes``): nothing is carried through the engine thread."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from tierserve.core.outputs import RequestOutput
from tierserve.tracing import attributes as at
from tierserve.tracing.spans import Span


def record_prefill(span: Span, first: RequestOutput) -> float | None:
    """Children of ``span`` for a request the engine computed the prompt of: ``tierserve.queue``
    (arrival to admission), inside it ``tierserve.l3_prefetch_wait`` (its L3 prefetch, until it let
    the request in), ``tierserve.prefix_match`` (at admission: the cached tokens by tier) and
    ``tierserve.prefill_compute`` (admission to the first token). Returns the first token's time
    (None without the engine's times)."""
    times = first.times
    if times is None or times.admitted is None:
        return None
    queue = span.record("tierserve.queue", times.arrival, times.admitted)
    if times.prefetch is not None and times.ready is not None:
        queue.record("tierserve.l3_prefetch_wait", times.prefetch, max(times.prefetch, times.ready))
    span.record("tierserve.prefix_match", times.admitted, times.admitted,
                at.cached(first.cached_tokens, first.cached_by_tier))
    span.record("tierserve.prefill_compute", times.admitted, times.first_token)
    return times.first_token


def record_decode(span: Span, start: float, last: RequestOutput | None, end: float) -> None:
    """``tierserve.decode`` from ``start`` (the first token) to ``end``, with the tokens made and
    how the request ended (``last``: its last output; None: it made none)."""
    attrs = {} if last is None else {at.COMPLETION_TOKENS: last.completion_tokens,
                                     at.FINISH_REASON: last.reason or "unfinished"}
    span.record("tierserve.decode", start, end, attrs)


def traced(span: Span, outputs: AsyncIterator[RequestOutput], reserved_since: float | None = None
           ) -> AsyncIterator[RequestOutput]:
    """``outputs`` as they come, with a request's engine spans under ``span`` (which the caller
    ends): ``record_prefill`` at the first output, or, for a reservation whose prompt another node
    computed (``reserved_since``: when its generation was asked for), ``tierserve.decode_queue``
    (until the engine started it) and ``tierserve.first_token`` (until its output was here); then
    ``record_decode`` once they end. ``outputs`` itself when ``span`` keeps nothing."""
    return _traced(span, outputs, reserved_since) if span.recording else outputs


async def _traced(span: Span, outputs: AsyncIterator[RequestOutput], reserved_since: float | None
                  ) -> AsyncIterator[RequestOutput]:
    first: float | None = None
    last: RequestOutput | None = None
    try:
        async with contextlib.aclosing(outputs) as items:
            async for out in items:
                if first is None:
                    first = _started(span, out, reserved_since)
                last = out
                yield out
    finally:
        if first is not None:
            record_decode(span, first, last, time.monotonic())


def _started(span: Span, first: RequestOutput, reserved_since: float | None) -> float:
    now = time.monotonic()
    if reserved_since is None:
        return record_prefill(span, first) or now
    if first.times is not None:
        started = max(reserved_since, first.times.first_token)
        span.record("tierserve.decode_queue", reserved_since, started)
        span.record("tierserve.first_token", started, now)
    return now


async def ending(span: Span, items: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """``items``; ``span`` ends with them (failed if they raise)."""
    with span:
        async with contextlib.aclosing(items) as outputs:
            async for out in outputs:
                yield out
