"""``tierserve up`` starts the whole cluster (L3 master, prefill, decode, router) on the built-in
model, answers a chat request through it, shows role-prefixed logs, and stops everything on SIGINT;
with ``--routers 2``, through either router.
Its plans, with ``launch.up`` faked, are tested in ``test_up_plan.py``."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.injected_faults import node_env, write_faults
from helpers.metrics import scrape, value
from helpers.processes import free_port, running_up, start_up

from tierserve.engine.config import EngineConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PAGE_SIZE = EngineConfig.page_size  # up's default
WRITE_DELAY_S = 0.8  # each L3 write call of the nodes (test fault): a follow-up finds the backup in flight


def test_up_serves_chat_and_stops_cleanly_on_ctrl_c() -> None:
    """At ``--log-level debug``, with Mooncake's lines that the default level drops
    (``test_observability.py``): the master's metrics report and the nodes' known noise."""
    port = free_port()
    proc, lines = start_up(port, "--max-total-tokens", "2048", "--log-level", "debug")
    try:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        text = "".join(lines)
        assert "curl http://127.0.0.1:" in text
        for role in ("[prefill-0]", "[decode-0]", "[router]"):
            assert role in text, role
        for shown in ("] Master Admin Metrics:", "] Local segment descriptor not found", "DEBUG tierserve.",
                      "INFO uvicorn.error"):
            assert shown in text, shown
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_prompt_sent_twice_is_served_from_storage_by_the_other_prefill_node_with_the_defaults(tmp_path: Path
                                                                                                 ) -> None:
    """Round robin sends the second copy, right after the first, to the node that never saw it,
    while the first node's L3 backup is still in flight (its writes take ``WRITE_DELAY_S``, a test
    fault). The router tells it the pages are on their way, so it waits for them and takes most of
    the prompt from storage instead of recomputing it (without that word it found none)."""
    port = free_port()
    prompt = [1000 + (i * 37) % 40000 for i in range(2000)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    faults = write_faults(tmp_path / "faults.json", {"ranks": [0], "set_delay_s": WRITE_DELAY_S})
    with running_up(port, "--prefill-nodes", "2", "--prefill-policy", "round_robin", "--max-total-tokens",
                    "8192", env=node_env(faults)) as lines:
        usages = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300).json()["usage"]
                  for _ in range(2)]
        state = httpx.get(f"http://127.0.0.1:{port}/debug/state", timeout=10).json()
    routes = state["routes"][-2:]
    assert routes[0]["prefill"] != routes[1]["prefill"], f"both copies went to {routes}"
    assert routes[1]["l3_pending_pages"] >= 0.9 * len(prompt) / PAGE_SIZE, routes
    assert usages[0]["cached_tokens_by_tier"]["storage"] == 0
    assert usages[1]["cached_tokens_by_tier"]["storage"] >= 0.9 * len(prompt), (usages, "".join(lines[-30:]))


def test_up_on_a_taken_port_stops_at_once_starting_nothing() -> None:
    """A second ``tierserve up`` on the same port started a whole cluster, then stopped it when its
    router could not bind (exit 1 after the nodes had loaded); it now says so before starting any."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        cmd = [sys.executable, "-m", "tierserve.cli", "up", "--port", str(port), "--device", "cpu"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert "mooncake-master" not in out.stdout + out.stderr, "a child was started"


def test_up_with_two_routers_serves_through_both_and_the_nodes_see_both() -> None:
    """``--routers 2``: routers on --port and --port + 1, listed in the banner; each answers, and
    every node has a session open with each (docs/router.md, several routers)."""
    port = free_port()
    while not _free(port + 1):
        port = free_port()
    with running_up(port, "--routers", "2", "--no-l3", "--max-total-tokens", "2048") as lines:
        text = "".join(lines)
        assert "2 routers on ports" in text
        urls = [f"http://127.0.0.1:{p}" for p in (port, port + 1)]
        for url in urls:
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        metrics = [line.split("metrics=")[1].split()[0] for line in lines if "role=prefill" in line
                   or "role=decode" in line]
        assert len(metrics) == 2 and {"router-0", "router-1"} <= {line.split()[0] for line in lines if "role=router"
                                                                  in line}
        for url in metrics:
            assert value(scrape(url), "tierserve_router_sessions") == 2, url


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
