"""``tierserve up``'s main loop: starts the cluster stage by stage, prints the banner, then
supervises it until Ctrl-C or SIGTERM (or a crash loop), and stops every child, newest first."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable

from tierserve.core.node_auth import TOKEN_ENV
from tierserve.launch.plan import ChildRole, ChildSpec, ClusterPlan, stages
from tierserve.launch.probes import grpc_serving, http_ok, listen_error, tcp_open
from tierserve.launch.process import Cluster, exit_description
from tierserve.launch.state import ClusterStatus, banner_lines, cluster_state, write_state
from tierserve.launch.supervisor import Supervisor

START_TIMEOUT_S = 600.0  # a cold machine converts the model and loads it in every node
POLL_S = 0.2  # how often the supervisor looks for dead children and due restarts

Announce = Callable[[str, list[str]], None]  # (router URL, one line per child) once the cluster is up


class _Run:
    """One ``up``: the cluster, its status, and the state file kept in step with both."""

    def __init__(self, plan: ClusterPlan) -> None:
        self.plan, self.cluster, self.status = plan, Cluster(), ClusterStatus.STARTING

    def publish(self, status: ClusterStatus | None = None) -> None:
        """Records a new status (if given) and rewrites the state file (if asked for one)."""
        self.status = status or self.status
        if self.plan.state_file is not None:
            write_state(self.plan.state_file, cluster_state(self.cluster.children, self.status, self.plan.router_url))


def up(plan: ClusterPlan, announce: Announce) -> int:
    """Runs the cluster until SIGINT/SIGTERM (0). A child that dies is restarted (see
    ``Supervisor``); 1 if a child died while the cluster was starting (a bad flag or model would
    only die again) or one child kept dying (a crash loop); 2 at once, starting nothing, if a
    router's port is taken (another ``up``, most likely)."""
    for port in plan.router_ports:
        if (error := listen_error(plan.host, port)) is not None:
            print(f"tierserve up: {error} (is another tierserve up running?)", file=sys.stderr, flush=True)
            return 2
    # One node token for the whole cluster, inherited by every child, never on their argv
    # (``core/node_auth.py``); a token the user exported is kept.
    os.environ.setdefault(TOKEN_ENV, secrets.token_hex(16))
    run, stop = _Run(plan), _stop_on_signals()
    try:
        _start_all(run, stop)
        if stop.is_set():
            return 0
        run.publish(ClusterStatus.UP)
        announce(plan.router_url, banner_lines(run.cluster.children))
        _supervise(run, stop)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"tierserve up: {exc}; stopping", file=sys.stderr, flush=True)
        return 1
    finally:
        run.cluster.stop()
        run.publish(ClusterStatus.STOPPED)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _supervise(run: _Run, stop: threading.Event) -> None:
    """Until stopped; raises ``CrashLoop``. Runs on the thread that started the children."""
    supervisor = Supervisor(run.cluster, run.plan.restart, run.publish)
    while not stop.wait(POLL_S):
        supervisor.tick()


def _start_all(run: _Run, stop: threading.Event) -> None:
    """Starts each stage once the one before is ready (returns early once ``stop`` is set)."""
    for stage in stages(run.plan):
        for spec in stage:
            run.cluster.launch(spec)
        run.publish()
        for spec in stage:
            _wait(spec, run.cluster, stop)
            if stop.is_set():
                return


def ready(spec: ChildSpec) -> bool:
    """The child serves: the master's RPC port accepts connections, a node's gRPC health says
    SERVING, the router has a healthy pair (``/readiness``)."""
    if spec.role is ChildRole.MASTER:
        return tcp_open(spec.ports.rpc)
    if spec.role is ChildRole.ROUTER:
        return http_ok(f"http://{spec.host}:{spec.ports.http}/readiness")
    return grpc_serving(f"{spec.host}:{spec.ports.grpc}", spec.tls)


def _wait(spec: ChildSpec, cluster: Cluster, stop: threading.Event) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready(spec):
        if stop.is_set():
            return
        if (dead := cluster.dead()) is not None:
            raise RuntimeError(f"{dead.name} exited with {exit_description(dead.returncode)} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spec.name} not ready after {START_TIMEOUT_S:.0f} s")
        stop.wait(0.1)  # poll interval
