"""Probes and port picks. ``http_ok`` says "not ready" for a port that answers with something other
than HTTP (a CI run's ``tierserve up`` died on the probe's ``BadStatusLine`` when another process
held a child's port); ``free_port`` picks ports nothing else will take before the caller binds them."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from tierserve.launch import probes
from tierserve.launch.probes import http_ok


def test_a_port_answering_garbage_is_not_ready() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"\x00\x01\xfe not http\r\n\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert http_ok(f"http://127.0.0.1:{server.getsockname()[1]}/readiness") is False
    finally:
        server.close()


def test_free_ports_avoid_the_kernels_ephemeral_range() -> None:
    """A CI run's router lost its picked port to an outgoing connection's local end: the kernel gives
    those from the ephemeral range, so picks must come from outside it."""
    low, high = probes.ephemeral_range()
    for port in (probes.free_port() for _ in range(50)):
        assert not low <= port <= high and port >= 20000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_two_processes_never_pick_the_same_port() -> None:
    """A test picks the router's port, then the ``tierserve up`` it starts picks its nodes' ports."""
    child = "from tierserve.launch.probes import free_port\nprint(*(free_port() for _ in range(300)))"
    other = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    mine = [probes.free_port() for _ in range(300)]
    theirs = [int(p) for p in other.communicate(timeout=60)[0].split()]
    assert len(theirs) == 300 and len(set(mine) | set(theirs)) == 600


def test_a_pick_is_reserved_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    port = probes.free_port()
    monkeypatch.setattr(probes, "_pick", lambda: port)
    with pytest.raises(OSError, match="no free loopback port"):
        probes.free_port()
    monkeypatch.setattr(probes, "_RESERVED_S", 0.0)
    assert probes.free_port() == port
