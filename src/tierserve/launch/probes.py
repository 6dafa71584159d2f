"""Readiness probes and free ports on loopback. Each probe answers at once (False when nothing
answers); callers poll them against a deadline."""

from __future__ import annotations

import http.client
import socket
import urllib.request
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierserve.core.node_auth import TLSFiles


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after; a race is possible)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def grpc_serving(address: str | int, tls: TLSFiles | None = None) -> bool:
    """The gRPC health service at ``host:port`` (or a local port) says SERVING (over TLS,
    presenting ``tls``'s certificate, when given)."""
    import grpc

    target = f"127.0.0.1:{address}" if isinstance(address, int) else address
    try:
        with _channel(target, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _channel(target: str, tls: TLSFiles | None) -> Any:
    import grpc

    return grpc.insecure_channel(target) if tls is None else \
        grpc.secure_channel(target, tls.channel_credentials(), options=tls.channel_options())


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200. Anything else is "not ready", including a port that answers
    with something other than HTTP (seen in CI: another process briefly held a child's port before
    it bound it, and the probe's ``BadStatusLine`` killed ``tierserve up``)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False
