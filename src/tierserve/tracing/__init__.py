"""OpenTelemetry traces of one request across router, prefill node and decode node
(``docs/tracing.md``). Torch-free; the OpenTelemetry SDK is imported only when a process is started
with ``--otlp-traces-endpoint`` (``start_tracing``): without it every span is ``NO_SPAN``, whose
methods do nothing."""

from tierserve.tracing.config import TracingConfig, start_tracing
from tierserve.tracing.spans import NO_SPAN, NO_TRACER, Span, SpanKind, Tracer, current_span, using

__all__ = ["NO_SPAN", "NO_TRACER", "Span", "SpanKind", "Tracer", "TracingConfig", "current_span", "start_tracing",
           "using"]
