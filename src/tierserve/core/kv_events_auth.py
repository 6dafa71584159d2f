"""The KV event stream under ZMQ CURVE when the cluster has a node token (``docs/tenancy.md``): both key pairs derive
from the token, so only its holders can subscribe (the publisher's ZAP handler admits the one client key) and the stream
is encrypted.

Derived, not distributed: a node and the router that share the token need nothing else, and a
changed token changes every key. Without a token the stream stays plaintext (bind it privately)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


@dataclass(frozen=True)
class CurveKeys:
    """The publisher's (server) and the subscribers' (client) key pairs, z85-encoded."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_token(cls, token: str) -> CurveKeys:
        server, client = (z85.encode(hashlib.sha256(f"tierserve kv events {side}\0{token}".encode()).digest())
                          for side in ("server", "client"))
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)


class _OneClient:
    """ZAP credentials: only the client key derived from the token."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key in (self.client_public, z85.decode(self.client_public))


def secure_publisher(ctx: zmq.Context, socket: zmq.Socket, keys: CurveKeys) -> ThreadAuthenticator:
    """Makes ``socket`` (before its bind) a CURVE server that admits only the token's subscribers;
    returns the authenticator thread, to stop with the context."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OneClient(keys.client_public))
    socket.curve_server = True
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    return auth


def secure_subscriber(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Makes ``socket`` (before its connect) a CURVE client of the token's publishers."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret
