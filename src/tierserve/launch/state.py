"""What ``tierserve up`` tells about its children, for people (the banner's table) and for
programs (the ``--state-file`` JSON, rewritten whenever a child starts, dies or restarts; the
format is in ``docs/cli.md``)."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Any

from tierserve.launch.process import Child

STATE_VERSION = 1


class ClusterStatus(Enum):
    STARTING = "starting"  # children are being started; not all are ready yet
    UP = "up"  # the banner was printed; dead children are restarted
    STOPPED = "stopped"  # ``up`` has stopped every child (Ctrl-C, SIGTERM, a crash loop or a failed start)


class ChildState(Enum):
    RUNNING = "running"
    RESTARTING = "restarting"  # dead, waiting for its next start
    STOPPED = "stopped"


def child_state(child: Child, status: ClusterStatus) -> ChildState:
    if status is ClusterStatus.STOPPED:
        return ChildState.STOPPED
    return ChildState.RESTARTING if child.restart_at is not None else ChildState.RUNNING


def describe(child: Child, status: ClusterStatus) -> dict[str, Any]:
    """One child as the state file lists it (ports it does not have are null)."""
    spec, ports = child.spec, child.spec.ports
    return {"name": spec.name, "role": spec.role.value if spec.role else None, "pid": child.pid,
            "state": child_state(child, status).value, "restarts": child.restarts, "host": spec.host,
            "grpc_port": ports.grpc, "http_port": ports.http, "metrics_port": ports.metrics, "rpc_port": ports.rpc,
            "kv_events_port": ports.kv_events, "metrics_url": spec.metrics_url}


def cluster_state(children: list[Child], status: ClusterStatus, router_url: str) -> dict[str, Any]:
    return {"version": STATE_VERSION, "status": status.value, "pid": os.getpid(), "router_url": router_url,
            "children": [describe(c, status) for c in children]}


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Replaces the file at once (write, then rename), so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def banner_lines(children: list[Child]) -> list[str]:
    """One line per child: name, role, its main port, metrics URL and PID, as ``key=value``
    fields (scripts can split them)."""
    return [_line(c) for c in children]


def _line(child: Child) -> str:
    spec, ports = child.spec, child.spec.ports
    main = next((f"{kind}={spec.host}:{port}" for kind, port in (("grpc", ports.grpc), ("http", ports.http),
                                                                  ("rpc", ports.rpc)) if port is not None), "")
    role = spec.role.value if spec.role else "-"
    return f"  {spec.name:<16} role={role:<16} {main:<22} metrics={spec.metrics_url}  pid={child.pid}"
