"""``tierserve up`` starts the whole cluster (L3 master, prefill, decode, router) on the built-in
model, answers a chat request through it, shows role-prefixed logs, and stops everything on SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from cluster import free_port

from tierserve.cli.flags import engine_config, engine_flags
from tierserve.cli.main import build_parser

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_serves_chat_and_stops_cleanly_on_ctrl_c() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "tierserve.cli", "up", "--port", str(port), "--max-total-tokens", "2048",
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("tierserve is up"):
                up.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not up.wait(0.2):
            assert proc.poll() is None, "".join(lines[-40:])
            assert time.monotonic() < deadline, "".join(lines[-40:])
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        text = "".join(lines)
        assert "curl http://127.0.0.1:" in text
        for role in ("[prefill-0]", "[decode-0]", "[router]"):
            assert role in text, role
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_flags_are_forwarded_to_every_node() -> None:
    args = build_parser().parse_args(["up", "--page-size", "32", "--enable-hierarchical-cache",
                                      "--hicache-mem-layout", "page_first", "--max-total-tokens", "2048"])
    flags = engine_flags(engine_config(args, Path("/m")))
    assert flags == ["--page-size", "32", "--max-total-tokens", "2048", "--enable-hierarchical-cache",
                     "--hicache-mem-layout", "page_first"]
    assert build_parser().parse_args(["prefill", *flags]).page_size == 32  # the nodes accept them
