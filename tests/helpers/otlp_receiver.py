"""An in-process OTLP/gRPC trace receiver on a loopback port it picks: what a collector (Jaeger,
Tempo) would get from tierserve's processes, kept as plain ``ReceivedSpan`` values for assertions
and benchmarks (``benchmarks/tracing_overhead.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

from helpers.polling import wait_for
from tierserve.launch import free_port

ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: ids in hex (``parent`` "" for a root), its process's resource attributes
    (``service.name``...), its own attributes, the names of its events, its status code."""

    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    resource: dict[str, object] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    status: int = 0

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name", ""))


def _value(any_value: common_pb2.AnyValue) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


def _attrs(pairs: object) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in pairs}  # type: ignore[attr-defined]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = [ReceivedSpan(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                                 s.start_time_unix_nano, s.end_time_unix_nano, _attrs(rs.resource.attributes),
                                 _attrs(s.attributes), tuple(e.name for e in s.events), s.status.code)
                    for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver:
    """The spans received so far (``spans()``), and the endpoint to send them to."""

    def __init__(self, collector: _Collector, port: int) -> None:
        self._collector, self.port = collector, port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._collector.lock:
            return [s for s in self._collector.spans if trace_id is None or s.trace_id == trace_id]


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A started receiver for the block, stopped after it."""
    collector, port = _Collector(), free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield Receiver(collector, port)
    finally:
        server.stop(grace=None)


def spans_of(receiver: Receiver, trace_id: str, names: set[str], deadline_s: float = 30.0) -> list[ReceivedSpan]:
    """The trace's spans once every one of ``names`` arrived."""
    wait_for(lambda: names <= {s.name for s in receiver.spans(trace_id)}, f"spans {sorted(names)}", deadline_s)
    return receiver.spans(trace_id)


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]
