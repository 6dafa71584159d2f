"""The OpenTelemetry SDK behind ``Tracer`` and ``Span``: imported only with tracing on. One
``TracerProvider`` per tracer, never the SDK's global one; spans go out through a
``BatchSpanProcessor`` (its own thread; ``OTEL_BSP_*`` variables tune it) to the OTLP/gRPC exporter."""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tierserve.tracing.spans import Attrs, Carrier, Span, SpanKind

if TYPE_CHECKING:
    from tierserve.tracing.config import TracingConfig

_KINDS = {SpanKind.SERVER: trace.SpanKind.SERVER, SpanKind.CLIENT: trace.SpanKind.CLIENT,
          SpanKind.INTERNAL: trace.SpanKind.INTERNAL}
_PROPAGATED = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
EXPORT_TIMEOUT_MS = 5000  # a collector that is gone must not hold up a process that stops (spans flush at exit)


class _Clock:
    """``time.monotonic()`` instants as OpenTelemetry's wall-clock nanoseconds. The clocks'
    difference is read once per ``REFRESH_S``, not per call: spans recorded together keep their
    order to the nanosecond (reading it twice can differ by a microsecond), and a wall clock that
    is adjusted is followed within seconds."""

    REFRESH_S = 10.0

    def __init__(self) -> None:
        self._offset, self._read_at = 0, -self.REFRESH_S

    def ns(self, monotonic: float) -> int:
        now = time.monotonic()
        if now - self._read_at >= self.REFRESH_S:
            self._offset, self._read_at = time.time_ns() - time.monotonic_ns(), now
        return self._offset + int(monotonic * 1e9)


class OtelSpan:
    """``Span`` over an SDK span (a trace not sampled: the SDK's non-recording span, whose
    ``headers`` still tell the next process not to sample it)."""

    def __init__(self, tracer: trace.Tracer, span: trace.Span, clock: _Clock) -> None:
        self._tracer, self._span, self._clock, self._ended = tracer, span, clock, False
        self.recording = span.is_recording()

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attrs: Attrs | None = None) -> Span:
        return self._start(name, kind, attrs, None)

    def record(self, name: str, start: float, end: float, attrs: Attrs | None = None) -> Span:
        span = self._start(name, SpanKind.INTERNAL, attrs, self._clock.ns(start))
        span._end_ns(self._clock.ns(end))
        return span

    def _start(self, name: str, kind: SpanKind, attrs: Attrs | None, start_ns: int | None) -> OtelSpan:
        context = trace.set_span_in_context(self._span)
        span = self._tracer.start_span(name, context, _KINDS[kind], attrs, start_time=start_ns)
        return OtelSpan(self._tracer, span, self._clock)

    def set(self, attrs: Attrs) -> None:
        self._span.set_attributes(attrs)

    def event(self, name: str, attrs: Attrs | None = None) -> None:
        self._span.add_event(name, attrs)

    def fail(self, message: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, message))

    def headers(self) -> list[tuple[str, str]]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(self._span))
        return list(carrier.items())

    def end(self, at: float | None = None) -> None:
        self._end_ns(None if at is None else self._clock.ns(at))

    def _end_ns(self, at: int | None) -> None:
        if not self._ended:  # the SDK warns of a second end
            self._ended = True
            self._span.end(at)

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        if isinstance(exc, Exception):
            self.fail(f"{type(exc).__name__}: {exc}")
        elif exc is not None:  # cancelled, or a generator closed early (the client went away): no failure
            self.event("tierserve.cancelled")
        self.end()


class OtelTracer:
    """``Tracer`` over its own ``TracerProvider``: parent-based sampling (a traced caller's choice
    holds; new traces are kept at ``sample_ratio``). What is buffered goes out when the process
    exits (the provider's exit hook)."""

    enabled = True

    def __init__(self, config: TracingConfig, service: str, instance: str = "") -> None:
        endpoint = config.endpoint or ""
        resource = Resource.create({"service.name": service, **({"service.instance.id": instance} if instance else {})})
        self._provider = TracerProvider(ParentBased(TraceIdRatioBased(config.sample_ratio)), resource)
        exporter = OTLPSpanExporter(endpoint, insecure=not endpoint.startswith("https://"),
                                    timeout=EXPORT_TIMEOUT_MS / 1000)
        self._provider.add_span_processor(BatchSpanProcessor(exporter, export_timeout_millis=EXPORT_TIMEOUT_MS))
        self._tracer, self._clock = self._provider.get_tracer("tierserve"), _Clock()

    def server(self, name: str, carrier: Carrier, attrs: Attrs | None = None) -> Span:
        context = _PROPAGATOR.extract(_propagated(carrier))
        return OtelSpan(self._tracer, self._tracer.start_span(name, context, trace.SpanKind.SERVER, attrs), self._clock)


def _propagated(carrier: Carrier) -> dict[str, str]:
    """The trace context entries of HTTP headers or gRPC metadata, by lower-case name."""
    pairs = carrier.items() if hasattr(carrier, "items") else carrier
    found = {}
    for key, value in pairs:
        if key.lower() in _PROPAGATED:
            found[key.lower()] = value.decode() if isinstance(value, bytes) else value
    return found
