"""``--otlp-traces-endpoint`` and ``--otlp-traces-sample-ratio`` as a config, and the tracer they give."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from tierserve.tracing.spans import NO_TRACER, Tracer


@dataclass(frozen=True)
class TracingConfig:
    """``endpoint``: an OTLP/gRPC collector (``host:port``, or ``http://`` / ``https://host:port``:
    plaintext unless ``https``); None: tracing off. ``sample_ratio``: the share of new traces kept;
    a request that comes with a ``traceparent`` follows its caller's decision instead (so every
    process of the cluster keeps the same traces)."""

    endpoint: str | None = None
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"--otlp-traces-sample-ratio must be in [0, 1], not {self.sample_ratio:g}")
        if self.endpoint is not None:
            check_endpoint(self.endpoint)

    def flags(self) -> list[str]:
        """The command line that gives this config, for a child process (``tierserve up``)."""
        if self.endpoint is None:
            return []
        return ["--otlp-traces-endpoint", self.endpoint, "--otlp-traces-sample-ratio", f"{self.sample_ratio:g}"]


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` when it names a host and a port (``ValueError`` otherwise)."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"--otlp-traces-endpoint must be host:port or http(s)://host:port, not {endpoint!r}")
    return endpoint


def start_tracing(config: TracingConfig, service: str, instance: str = "") -> Tracer:
    """The process's tracer: ``NO_TRACER`` when ``config`` has no endpoint (the SDK is never
    imported), else spans of ``service`` (the resource's ``service.name``; ``instance``, e.g. the
    node's address, its ``service.instance.id``) sent in batches to the endpoint."""
    if config.endpoint is None:
        return NO_TRACER
    from tierserve.tracing.otel import OtelTracer

    return OtelTracer(config, service, instance)
