"""``http_ok`` says "not ready" for a port that answers with something other than HTTP (a CI run's
``tierserve up`` died on the probe's ``BadStatusLine`` when another process held a child's port)."""

from __future__ import annotations

import socket
import threading

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
