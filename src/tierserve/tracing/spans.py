"""The span and tracer interfaces the serving code calls, and their no-op forms (tracing off).

Times are ``time.monotonic()`` seconds, the clock the engine stamps its requests with
(``RequestTimes``): a span made after the fact from the engine's times needs no context carried
through the engine thread. Attribute keys are full names (``tracing/attributes.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from enum import Enum
from types import TracebackType
from typing import Protocol

AttrValue = str | int | float | bool
Attrs = Mapping[str, AttrValue]
Carrier = Mapping[str, str] | Sequence[tuple[str, str | bytes]]  # HTTP headers or gRPC metadata


class SpanKind(Enum):
    """OpenTelemetry's span kinds we use: a call received, a call made, work inside a process."""

    SERVER = "server"
    CLIENT = "client"
    INTERNAL = "internal"


class Span(Protocol):
    """One span, started. A context manager: it ends on leaving the block, failed if an exception
    left it. Ended spans take no attributes but may still parent spans recorded after the fact."""

    @property
    def recording(self) -> bool:
        """Whether anything is kept (False: tracing off, or this trace not sampled)."""
        ...

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attrs: Attrs | None = None) -> Span:
        """A child span starting now."""
        ...

    def record(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> Span:
        """A child span that ran from ``start`` to ``end`` (monotonic seconds), already ended."""
        ...

    def set(self, attrs: Attrs) -> None: ...

    def event(self, name: str, attrs: Attrs | None = None) -> None: ...

    def fail(self, message: str) -> None:
        """Marks the span's status an error, with ``message``."""
        ...

    def headers(self) -> list[tuple[str, str]]:
        """The W3C ``traceparent`` (and ``tracestate``) naming this span: gRPC metadata for a call it makes."""
        ...

    def end(self, at: float | None = None) -> None:
        """Ends the span now or at ``at`` (monotonic seconds); a second call does nothing."""
        ...

    def __enter__(self) -> Span: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None: ...


class Tracer(Protocol):
    """Makes the spans of calls a process receives; every other span is a child of one."""

    @property
    def enabled(self) -> bool: ...

    def server(self, name: str, carrier: Carrier, attrs: Attrs | None = None) -> Span:
        """A span for a received call: a child of the ``traceparent`` in ``carrier`` (HTTP headers,
        gRPC metadata), or the root of a new trace when it has none."""
        ...


class _NoSpan:
    """Tracing off: nothing is kept, every call is a no-op, children are this span again."""

    recording = False

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attrs: Attrs | None = None) -> Span:
        return self

    def record(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> Span:
        return self

    def set(self, attrs: Attrs) -> None:
        pass

    def event(self, name: str, attrs: Attrs | None = None) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def headers(self) -> list[tuple[str, str]]:
        return []

    def end(self, at: float | None = None) -> None:
        pass

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        pass


class _NoTracer:
    enabled = False

    def server(self, name: str, carrier: Carrier, attrs: Attrs | None = None) -> Span:
        return NO_SPAN


NO_SPAN: Span = _NoSpan()
NO_TRACER: Tracer = _NoTracer()

# The span of the API request being served, for the backend's spans (asyncio tasks copy it when
# created): the one value the HTTP layer hands the backend without a parameter of the ``Backend``
# protocol. NO_SPAN unless a traced request set it.
_current: ContextVar[Span] = ContextVar("tierserve_span", default=NO_SPAN)


def current_span() -> Span:
    """The span ``using`` made current in this task (or the task that created it); NO_SPAN if none."""
    return _current.get()


@contextlib.contextmanager
def using(span: Span) -> Iterator[Span]:
    """``span`` is ``current_span()`` in the block, and in the tasks created in it."""
    token = _current.set(span)
    try:
        yield span
    finally:
        _current.reset(token)
