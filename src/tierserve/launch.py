"""``tierserve up``: a whole local cluster in one command. Starts ``mooncake_master`` (the shared
L3), N prefill and M decode nodes and the router as child processes, shows their logs prefixed by
role, waits until the router is ready, and stops everything on Ctrl-C (or when a child dies)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

_PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 600.0  # a cold machine converts the model and loads it in every node


@dataclass(frozen=True)
class ClusterPlan:
    """What to start; ``node_flags`` go to every node (engine and cache flags). With L3, the nodes
    get the Mooncake backend with ``l3_config`` (the user's extra config, e.g. prefetch settings)
    plus the master's address, and each contributes ``l3_segment_bytes`` to the shared store
    unless that config names its own ``global_segment_size``."""

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_nodes: int = 1
    decode_nodes: int = 1
    with_l3: bool = True
    node_flags: list[str] = field(default_factory=list)
    router_flags: list[str] = field(default_factory=list)
    l3_config: dict = field(default_factory=dict)
    l3_segment_bytes: int = 256 << 20


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


class Cluster:
    """The running children, in start order; ``stop`` ends them in reverse."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stopping = threading.Event()

    def start(self, name: str, args: list[str]) -> Child:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True,  # Ctrl-C reaches us only; we stop them in order
                                preexec_fn=_die_with_parent)
        child = Child(name, proc)
        self.children.append(child)
        threading.Thread(target=_relay, args=(child,), daemon=True).start()
        return child

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        """Stops the children one by one, newest first, so each can still reach what it depends on
        while it shuts down (the nodes unmount their L3 segments from the master last)."""
        self.stopping.set()
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.terminate()
            try:
                child.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def _die_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM if ``tierserve up`` dies (even by SIGKILL),
    so no node outlives the command that started it."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: Ctrl-C and SIGTERM still stop everything
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _relay(child: Child) -> None:
    """Copies a child's output to ours, each line prefixed by its role."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        sys.stdout.write(f"[{child.name}] {line}")
        sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(plan: ClusterPlan, announce: Callable[[str], None]) -> int:
    """Runs the cluster until SIGINT/SIGTERM; returns the exit status (1 if a child died)."""
    cluster = Cluster()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        _start_all(plan, cluster, stop)
        if stop.is_set():
            return 0
        announce(f"http://{plan.host}:{plan.port}")
        while not stop.wait(0.5):
            if (dead := cluster.dead()) is not None:
                print(f"tierserve up: {dead.name} exited with {dead.proc.returncode}; stopping", file=sys.stderr)
                return 1
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"tierserve up: {exc}; stopping", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def _start_all(plan: ClusterPlan, cluster: Cluster, stop: threading.Event) -> None:
    flags = list(plan.node_flags)
    if plan.with_l3:
        rpc, metrics = free_port(), free_port()
        master = str(Path(sys.executable).parent / "mooncake_master")
        cluster.start("mooncake-master", [master, f"--rpc_port={rpc}", f"--metrics_port={metrics}"])
        _wait(lambda: tcp_open(rpc), "mooncake_master", cluster, stop)
        flags += l3_flags(plan, rpc)
    nodes = {"prefill": [free_port() for _ in range(plan.prefill_nodes)],
             "decode": [free_port() for _ in range(plan.decode_nodes)]}
    cli = [sys.executable, "-m", "tierserve.cli"]
    for role, ports in nodes.items():
        for i, port in enumerate(ports):
            cluster.start(f"{role}-{i}", [*cli, role, "--model", str(plan.model_dir), "--port", str(port),
                                          "--kv-events-port", "0", *flags])  # for the router's cache-aware policy
    for role, ports in nodes.items():
        for i, port in enumerate(ports):
            _wait(lambda p=port: grpc_serving(p), f"{role}-{i}", cluster, stop)
    workers = [f for role, ports in nodes.items() for p in ports for f in (f"--{role}", f"127.0.0.1:{p}")]
    cluster.start("router", [*cli, "router", "--model", str(plan.model_dir), "--host", plan.host,
                             "--port", str(plan.port), *workers, *plan.router_flags])
    _wait(lambda: http_ok(f"http://{plan.host}:{plan.port}/readiness"), "router", cluster, stop)


def l3_flags(plan: ClusterPlan, rpc_port: int) -> list[str]:
    """The nodes' L3 flags: Mooncake behind the master at ``rpc_port``, with the plan's extra config."""
    l3 = {"global_segment_size": plan.l3_segment_bytes, **plan.l3_config,
          "master_server_address": f"127.0.0.1:{rpc_port}"}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3)]


def _wait(ready: Callable[[], bool], what: str, cluster: Cluster, stop: threading.Event) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if stop.is_set():
            return
        if (dead := cluster.dead()) is not None:
            raise RuntimeError(f"{dead.name} exited with {dead.proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {START_TIMEOUT_S:.0f} s")
        stop.wait(0.1)  # poll interval


# Readiness probes (each answers at once; callers poll them against a deadline).


def tcp_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def grpc_serving(address: str | int) -> bool:
    """The gRPC health service at ``host:port`` (or a local port) says SERVING."""
    import grpc

    target = f"127.0.0.1:{address}" if isinstance(address, int) else address
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
