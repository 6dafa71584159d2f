"""Readiness probes and free ports on loopback. Each probe answers at once (False when nothing
answers); callers poll them against a deadline."""

from __future__ import annotations

import functools
import http.client
import os
import random
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierserve.core.node_auth import TLSFiles

# Ports under 20000 are left alone: Mooncake's engines and store clients take theirs below 17000
# (docs/mooncake.md).
_LOWEST_PICK = 20000
# A pick is kept from every other process's picks this long: the caller binds it well before.
_RESERVED_S = 600.0


def free_port() -> int:
    """A loopback port nothing listens on now and no process on this machine picked in the last
    ten minutes.

    It comes from outside the kernel's ephemeral range when that leaves room: the kernel gives
    ephemeral ports to outgoing connections too (gRPC, gloo, Mooncake), so a port picked there could
    be taken as some connection's local end before the caller binds it (a CI run's router lost its
    port that way). Picks are reserved by files under the temp folder, so a test and the
    ``tierserve up`` it starts never pick the same port."""
    for _ in range(200):
        port = _pick()
        if port_taken("127.0.0.1", port) is None and _reserve(port):
            return port
    raise OSError("no free loopback port outside the ephemeral range")


@functools.cache
def _reservations() -> Path:
    folder = Path(tempfile.gettempdir()) / f"tierserve-ports-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return folder


def _reserve(port: int) -> bool:
    mark = _reservations() / str(port)
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return _take_expired(mark)


def _take_expired(mark: Path) -> bool:
    """Two processes may both see an expired mark; the rename lets only one of them take it."""
    try:
        if time.time() - mark.stat().st_mtime < _RESERVED_S:
            return False
        mark.rename(claimed := mark.with_suffix(f".{os.getpid()}"))
        claimed.unlink()
    except FileNotFoundError:
        return False
    return _reserve(int(mark.name))


def _pick() -> int:
    low, high = ephemeral_range()
    outside = [r for r in (range(_LOWEST_PICK, low), range(high + 1, 65536)) if len(r) > 0]
    if sum(map(len, outside)) < 1000:
        with socket.socket() as s:  # the kernel's range covers nearly everything: let it choose
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return random.choice(random.choices(outside, weights=list(map(len, outside)))[0])


@functools.cache
def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it chooses itself (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (None: it can). Binds as uvicorn does
    (``SO_REUSEADDR``), so a port left in TIME_WAIT by a cluster just stopped counts as free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def listen_error(host: str, port: int) -> str | None:
    """What to tell a user whose ``--port`` is taken (None: it is free), before anything loads."""
    why = port_taken(host, port)
    return None if why is None else f"cannot listen on {host}:{port} ({why}); choose another port with --port"


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
