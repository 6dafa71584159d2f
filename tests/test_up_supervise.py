"""``tierserve up`` supervises its cluster (issue 13, defect 8): a killed node, master or router
comes back at the same ports while ``up`` keeps running; a child that keeps dying stops ``up``
with status 1; the banner and ``--state-file`` list every child's role, ports, metrics URL and
PID, and each metrics URL answers.

One cluster (tiny model, L3) serves the whole module; the crash-loop test ends it, so it comes
last. The supervisor's backoff and crash-loop rules also have a unit test on short-lived shell
processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2_grpc
from helpers.processes import alive, cmdline, free_port

from tierserve.launch import Cluster, RestartPolicy, grpc_serving, tcp_open
from tierserve.launch.supervisor import CrashLoop, Supervisor

RESTART_LIMIT = 3  # deaths of one child within the window that stop up (the last test makes them)
SPAWNS_UNDER_GRPC = 100  # before the fix, one of 20 to 120 children aborted
BODY = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def poll(check: Callable[[], Any], what: str, deadline_s: float = 120.0) -> Any:
    """``check()``'s first truthy value, polled until the deadline."""
    deadline = time.monotonic() + deadline_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # poll interval
    return value


class Up:
    """``tierserve up`` as a process: its output lines (stdout and stderr) and its state file."""

    def __init__(self, model: Path, state_file: Path) -> None:
        self.port, self.state_file, self.lines = free_port(), state_file, []
        cmd = [sys.executable, "-m", "tierserve.cli", "up", "--model", str(model), "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048", "--l3-size-gb", "0.5",
               "--state-file", str(state_file), "--restart-limit", str(RESTART_LIMIT), "--restart-window", "120"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_up(self) -> Up:
        poll(lambda: self.proc.poll() is not None or "tierserve is up" in self.output(), "the banner", 300)
        assert self.proc.poll() is None, "tierserve up exited:\n" + self.output()[-4000:]
        return self

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.state()["children"] if c["name"] == name)

    def complete(self) -> int:
        try:
            return httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=BODY, timeout=60).status_code
        except httpx.TransportError:
            return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory) -> Iterator[Up]:
    proc = Up(tiny_llama, tmp_path_factory.mktemp("up") / "state.json")
    try:
        yield proc.wait_up()
    finally:
        proc.stop()


def kill_and_wait_restart(up: Up, name: str) -> dict[str, Any]:
    """SIGKILL to the child's process; its state once ``up`` started it again (a new PID)."""
    old = up.child(name)
    os.kill(old["pid"], signal.SIGKILL)
    new = poll(lambda: (c := up.child(name))["pid"] not in (None, old["pid"]) and c, f"{name} restarted", 60)
    assert up.proc.poll() is None, "tierserve up stopped:\n" + up.output()[-3000:]
    return old | {"restarted": new}


@pytest.mark.integration
@pytest.mark.slow
def test_banner_and_state_file_list_every_child_with_a_metrics_port_that_answers(up: Up) -> None:
    state = up.state()
    assert state["status"] == "up" and state["pid"] == up.proc.pid
    assert state["router_url"] == f"http://127.0.0.1:{up.port}"
    roles = {c["name"]: c["role"] for c in state["children"]}
    assert roles == {"mooncake-master": "mooncake_master", "prefill-0": "prefill", "decode-0": "decode",
                     "router": "router"}
    banner = up.output()
    for child in state["children"]:
        assert child["state"] == "running" and child["restarts"] == 0
        os.kill(child["pid"], 0)  # alive
        assert child["metrics_url"] == f"http://127.0.0.1:{child['metrics_port']}/metrics"
        text = httpx.get(child["metrics_url"], timeout=10).text
        assert ("master_" if child["role"] == "mooncake_master" else "tierserve_") in text, child
        port = child["grpc_port"] or child["http_port"] or child["rpc_port"]
        kind = "grpc" if child["grpc_port"] else "http" if child["http_port"] else "rpc"
        line = next(x for x in banner.splitlines() if x.strip().startswith(child["name"] + " "))
        for field in (f"role={child['role']}", f"{kind}=127.0.0.1:{port}", f"metrics={child['metrics_url']}",
                      f"pid={child['pid']}"):
            assert field in line, (field, line)
    node = up.child("decode-0")
    assert "tierserve_kv_pages_total" in httpx.get(node["metrics_url"], timeout=10).text  # page accounting
    assert up.complete() == 200


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_decode_node_comes_back_at_the_same_port_and_serves(up: Up) -> None:
    assert up.complete() == 200
    old = kill_and_wait_restart(up, "decode-0")
    new = old["restarted"]
    assert (new["grpc_port"], new["metrics_port"], new["restarts"]) == (old["grpc_port"], old["metrics_port"], 1)
    poll(lambda: grpc_serving(new["grpc_port"]), "the restarted decode node serving at its old port")
    poll(lambda: up.complete() == 200, "a request through the router after the restart")
    assert [up.complete() for _ in range(3)] == [200] * 3
    assert up.proc.poll() is None
    logged = [x for x in up.lines if f"decode-0 (pid {old['pid']}) exited with signal SIGKILL" in x]
    assert len(logged) == 1 and "restarting in 1.0 s" in logged[0], logged


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_mooncake_master_comes_back_at_the_same_port(up: Up) -> None:
    old = kill_and_wait_restart(up, "mooncake-master")
    assert old["restarted"]["rpc_port"] == old["rpc_port"]
    poll(lambda: tcp_open(old["rpc_port"]), "the restarted master listening at its old port")
    assert [up.complete() for _ in range(3)] == [200] * 3  # the nodes' L3 recovers or degrades; requests succeed


@pytest.mark.integration
@pytest.mark.slow
def test_a_crash_loop_stops_up_with_status_1(up: Up) -> None:
    """Ends the module's cluster: the router dies ``RESTART_LIMIT`` times within the window."""
    pids = {c["pid"] for c in up.state()["children"]}
    for _ in range(RESTART_LIMIT - 1):
        pids.add(kill_and_wait_restart(up, "router")["restarted"]["pid"])
    os.kill(up.child("router")["pid"], signal.SIGKILL)
    assert up.proc.wait(timeout=120) == 1
    assert f"router died {RESTART_LIMIT} times within 120 s" in up.output() and "crash loop" in up.output()
    state = up.state()
    assert state["status"] == "stopped" and all(c["pid"] is None for c in state["children"])
    for pid in pids:  # every child was stopped with up
        assert not Path(f"/proc/{pid}").exists() or b"tierserve" not in Path(f"/proc/{pid}/cmdline").read_bytes()


def _exits(cluster: Cluster) -> None:
    poll(lambda: all(c.exited() for c in cluster.children), "the child exited", 10)


def test_supervisor_restarts_with_exponential_backoff_and_stops_a_crash_loop(capsys) -> None:
    cluster, changes = Cluster(), []
    child = cluster.start("flaky", ["sh", "-c", "exit 3"])
    supervisor = Supervisor(cluster, RestartPolicy(first_delay_s=1.0, max_deaths=3, window_s=60),
                            lambda: changes.append(child.pid))

    def dies_at(now: float) -> float | None:
        """Lets the child exit, ticks at ``now``; when it is due to start again."""
        _exits(cluster)
        supervisor.tick(now=now)
        return child.restart_at

    assert dies_at(100.0) == 101.0 and child.pid is None
    supervisor.tick(now=100.9)
    assert child.restarts == 0  # not before its delay
    supervisor.tick(now=101.0)
    assert child.restarts == 1 and child.restart_at is None
    assert dies_at(102.0) == 104.0, "a second death within the window doubles the delay"
    supervisor.tick(now=104.0)
    assert dies_at(200.0) == 201.0, "the first two deaths left the window: the delay starts over"
    supervisor.tick(now=201.0)
    assert dies_at(202.0) == 204.0
    supervisor.tick(now=204.0)
    with pytest.raises(CrashLoop, match="flaky died 3 times within 60 s"):
        dies_at(205.0)
    err = capsys.readouterr().err
    assert err.count("flaky (pid") == 4 and "exited with code 3; restarting in 2.0 s" in err
    assert err.count("flaky restarted as pid") == 4
    assert len(changes) == 8  # every death and restart rewrote the state


def test_restart_delays_double_up_to_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(max_deaths=0)


def test_children_started_while_up_probes_grpc_neither_abort_nor_outlive_up() -> None:
    """gRPC's fork handlers, with gRPC calls running in ``up``'s process (its probes), aborted a
    child forked by a ``preexec_fn`` before its exec (a router dead at start with SIGABRT in CI, about
    1 child in 100 here): children start through vfork and set their parent-death signal themselves,
    and still die with ``up``."""
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port, probing = server.add_insecure_port("127.0.0.1:0"), threading.Event()
    server.start()

    def probe() -> None:
        while not probing.is_set():
            grpc_serving(port)

    probers = [threading.Thread(target=probe) for _ in range(3)]
    for prober in probers:
        prober.start()
    try:
        for n in range(SPAWNS_UNDER_GRPC):
            child = Cluster().start(f"child-{n}", ["true"])
            assert child.proc.wait(30) == 0, n
    finally:
        probing.set()
        for prober in probers:
            prober.join()
        server.stop(0)
    _a_child_dies_with_its_up()


def _a_child_dies_with_its_up() -> None:
    """A parent that starts a child through ``Cluster`` then is SIGKILLed: its child gets SIGTERM."""
    script = ("import time; from tierserve.launch import Cluster; c = Cluster(); c.start('sleeper', ['sleep', '120']); "
              "print(c.children[0].pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        poll(lambda: b"sleep" in cmdline(child), "the child execs its command", 30)
    finally:
        parent.kill()
        parent.wait()
    poll(lambda: not alive(child), "the child dies with its parent", 10)
