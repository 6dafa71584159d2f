"""Authenticated node traffic (``docs/tenancy.md``): every gRPC call to
a node carries a shared token (``--node-token`` / ``--node-token-file`` / ``TIERSERVE_NODE_TOKEN``)
that the node checks before any handler runs. The gRPC health service stays open: probes
(Kubernetes, ``up``) cannot send metadata, and it says nothing beyond SERVING."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_KEY = "tierserve-node-token"  # gRPC metadata key
TOKEN_ENV = "TIERSERVE_NODE_TOKEN"  # how ``up`` hands the token to its children (not on their argv)
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def read_token(literal: str | None, file: Path | None) -> str | None:
    """The token of ``--node-token``, else of ``--node-token-file`` (stripped), else of the
    environment; ``None``: node traffic is not authenticated. ``ValueError`` for an empty one."""
    token = literal if literal is not None else file.read_text().strip() if file is not None \
        else os.environ.get(TOKEN_ENV)
    if token is not None and not token:
        raise ValueError("the node token is empty")
    return token


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call whose metadata lacks the token, before its handler."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES) or self._valid(details.invocation_metadata or ()):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler)

    def _valid(self, metadata: Any) -> bool:
        sent = next((v for k, v in metadata if k == TOKEN_KEY), None)
        return sent is not None and hmac.compare_digest(str(sent).encode(), self._token)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape as ``handler`` that aborts at once."""
    if handler is None:
        return None

    async def abort(_: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong node token")

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](
        abort, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _with_token(details: Any, token: str) -> Any:
    metadata = [*(details.metadata or ()), (TOKEN_KEY, token)]
    return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)


class _Details(grpc.aio.ClientCallDetails):
    def __new__(cls, details: Any, metadata: list[tuple[str, str]]) -> _Details:
        return super().__new__(cls, details.method, details.timeout, metadata, details.credentials,
                               details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


def client_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor] | None:
    """What an aio channel to the nodes needs to send ``token`` on every call (None: nothing)."""
    return None if token is None else [_UnaryUnary(token), _UnaryStream(token)]


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of ``--tls-cert``, ``--tls-key``, ``--tls-ca``. A node serves TLS with its
    certificate and, given a CA, requires callers' certificates signed by it (mutual TLS); the
    router verifies nodes against the CA and presents its own certificate when it has one.
    ``server_name`` (the router's ``--tls-server-name``) is the name the router checks the nodes'
    certificates for instead of the address it dials: on Kubernetes it dials pod IPs, which no
    certificate made before the pods can name (docs/tenancy.md)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_name: str | None = None

    @classmethod
    def of(cls, cert: Path | None, key: Path | None, ca: Path | None,
           server_name: str | None = None) -> TLSFiles | None:
        """``None`` when no flag was given; ``ValueError`` for a certificate without its key, or a
        server name without TLS to check it in."""
        if (cert is None) != (key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if cert is None and ca is None:
            if server_name is not None:
                raise ValueError("--tls-server-name needs TLS to the nodes (--tls-ca, --tls-cert)")
            return None
        return cls(cert, key, ca, server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a node serving TLS needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=_read(self.ca), require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(self.ca), _read(self.key), _read(self.cert))

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel arguments that make the TLS handshake check ``server_name`` rather than the target."""
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def node_channel(address: str, token: str | None, tls: TLSFiles | None) -> grpc.aio.Channel:
    """An aio channel to a node: TLS when ``tls`` is set, the token on every call when set."""
    interceptors = client_interceptors(token)
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=tls.channel_options(),
                                   interceptors=interceptors)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [] if token is None else [TokenCheck(token)]
