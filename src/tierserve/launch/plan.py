"""What ``tierserve up`` starts: the plan from the command line, and one ``ChildSpec`` per child
with every port fixed up front, so a restarted child comes back where the others know it."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tierserve.core.logs import third_party_verbose
from tierserve.core.node_auth import TLSFiles
from tierserve.launch.probes import free_port
from tierserve.launch.tls import ClusterTLS


@dataclass(frozen=True)
class RestartPolicy:
    """A dead child is started again after ``first_delay_s``, doubling with each of its deaths
    within ``window_s`` up to ``max_delay_s``. ``max_deaths`` deaths of one child within
    ``window_s`` are a crash loop: ``up`` stops everything."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_deaths: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_deaths < 1 or self.window_s <= 0 or self.first_delay_s < 0:
            raise ValueError("a restart policy needs max_deaths >= 1, window_s > 0 and first_delay_s >= 0")

    def delay(self, recent_deaths: int) -> float:
        """Seconds before the next start of a child that died ``recent_deaths`` (>= 1) times
        within the window."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (recent_deaths - 1))


@dataclass(frozen=True)
class ClusterPlan:
    """What to start; ``node_flags`` go to every node (engine and cache flags). With L3, the nodes
    get the Mooncake backend with ``l3_config`` (the user's extra config, e.g. prefetch settings)
    plus the master's address, and each contributes ``l3_segment_bytes`` to the shared store
    unless that config names its own ``global_segment_size``. ``state_file``: where ``up`` keeps
    the children's roles, PIDs and ports as JSON (``launch.state``); None: nowhere.
    ``prefill_tp`` and ``decode_tp``: each node's rank processes (``--tp-size``) per role, per stage
    of ``prefill_pp`` and ``decode_pp`` pipeline stages (``--pp-size``); ``prefill_cp`` and
    ``decode_cp``: each node's context-parallel ranks (``--cp-size``) per role; ``prefill_pp_partition``
    and ``decode_pp_partition``: each role's layers per stage (``--pp-layer-partition``; None: the
    default split). ``routers``: router processes in front of the same nodes, on ports ``port``,
    ``port + 1``, ... (``docs/router.md``, several routers). ``tls``: the nodes
    serve mutual TLS with its certificates and the router presents its client certificate
    (``launch/tls.py``); None: plaintext on loopback."""

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
    state_file: Path | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    prefill_flags: list[str] = field(default_factory=list)  # after ``node_flags``, for prefill nodes only
    decode_flags: list[str] = field(default_factory=list)
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    decode_pp: int = 1
    prefill_cp: int = 1
    tls: ClusterTLS | None = None
    prefill_pp_partition: tuple[int, ...] | None = None
    decode_pp_partition: tuple[int, ...] | None = None
    decode_cp: int = 1
    routers: int = 1
    log_level: str = "info"  # ``up``'s --log-level: below debug, Mooncake's INFO lines and known noise are dropped

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ValueError("a cluster needs at least one router")

    def role_flags(self, role: ChildRole) -> list[str]:
        """A role's own flags: its TP, PP and CP sizes (when above 1), its layer partition (when
        given), then the user's ``--<role>-args``."""
        tp = {ChildRole.PREFILL: self.prefill_tp, ChildRole.DECODE: self.decode_tp}.get(role, 1)
        pp = {ChildRole.PREFILL: self.prefill_pp, ChildRole.DECODE: self.decode_pp}.get(role, 1)
        cp = {ChildRole.PREFILL: self.prefill_cp, ChildRole.DECODE: self.decode_cp}.get(role, 1)
        own = {ChildRole.PREFILL: self.prefill_flags, ChildRole.DECODE: self.decode_flags}.get(role, [])
        sizes = [f for flag, n in (("--tp-size", tp), ("--pp-size", pp), ("--cp-size", cp)) if n > 1
                 for f in (flag, str(n))]
        partition = {ChildRole.PREFILL: self.prefill_pp_partition, ChildRole.DECODE: self.decode_pp_partition}.get(role)
        layers = ["--pp-layer-partition", ",".join(map(str, partition))] if partition is not None else []
        return [*sizes, *layers, *own]

    @property
    def router_url(self) -> str:
        return f"http://{_reachable(self.host)}:{self.port}"

    @property
    def router_ports(self) -> list[int]:
        """Every router's HTTP port, the first one's ``port``."""
        return [self.port + i for i in range(self.routers)]


class ChildRole(Enum):
    MASTER = "mooncake_master"
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


@dataclass(frozen=True)
class Ports:
    """A child's listening ports (None: it has no such port). The router's metrics are on its
    HTTP port; the master's RPC port is its own protocol, not gRPC."""

    grpc: int | None = None
    http: int | None = None
    metrics: int | None = None
    rpc: int | None = None
    kv_events: int | None = None


@dataclass(frozen=True)
class ChildSpec:
    """One child process: ``argv`` names all its ports, so starting it again after a death
    brings it back at the same addresses with the same flags. ``role`` None: a process that is
    no part of a ``tierserve up`` cluster (scripts reuse ``Cluster``)."""

    name: str
    role: ChildRole | None
    argv: tuple[str, ...]
    ports: Ports = Ports()
    host: str = "127.0.0.1"
    tls: TLSFiles | None = None  # what probes of its gRPC port present (it serves TLS)
    hidden: tuple[str, ...] = ()  # output lines containing one of these are not relayed (``KNOWN_NOISE``)

    @property
    def metrics_url(self) -> str | None:
        return None if self.ports.metrics is None else f"http://{self.host}:{self.ports.metrics}/metrics"


def stages(plan: ClusterPlan) -> list[list[ChildSpec]]:
    """The children in start order, by stage: each stage starts once the one before is ready
    (master, then the nodes, then the routers, which need a healthy pair)."""
    master = _master(plan.log_level) if plan.with_l3 else None
    flags = [*plan.node_flags, *(l3_flags(plan, master.ports.rpc) if master else []),
             *(plan.tls.node_flags() if plan.tls else [])]
    nodes = [_node(plan, role, i, flags) for role, n in ((ChildRole.PREFILL, plan.prefill_nodes),
                                                         (ChildRole.DECODE, plan.decode_nodes)) for i in range(n)]
    routers = [_router(plan, nodes, i) for i in range(plan.routers)]
    return [s for s in ([master] if master else [], nodes, routers) if s]


def _cli() -> list[str]:
    return [sys.executable, "-m", "tierserve.cli"]


# Lines Mooncake prints on every start that report nothing wrong; ``up`` drops them from its output
# unless --log-level debug (docs/observability.md, Logs). Whole phrases, so no other line matches.
KNOWN_NOISE = (
    # glog, in the master and every node: logging starts before glog's init (once per process)
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    # the transfer engine, at ERROR, in every node as each of its Mooncake clients starts; L3 and the
    # handoff work after it. Mooncake's log level cannot drop it without dropping real errors.
    "] Local segment descriptor not found",
    # the master, twice for each segment a node mounts (the mount succeeds)
    ", warn=segment_already_exists",
)
GLOG_LEVELS = {"debug": 0, "info": 1, "warning": 1, "error": 2}  # glog: 0 INFO, 1 WARNING, 2 ERROR


def _master(log_level: str) -> ChildSpec:
    """``mooncake_master``; below debug it logs warnings and errors only (glog's ``--minloglevel``):
    its INFO lines include a metrics dump every 10 s (``--metrics_port`` serves the same figures)."""
    ports = Ports(rpc=free_port(), metrics=free_port())
    binary = str(Path(sys.executable).parent / "mooncake_master")
    argv = (binary, f"--rpc_port={ports.rpc}", f"--metrics_port={ports.metrics}",
            f"--minloglevel={GLOG_LEVELS[log_level]}")
    return ChildSpec("mooncake-master", ChildRole.MASTER, argv, ports, hidden=_hidden(log_level))


def _hidden(log_level: str) -> tuple[str, ...]:
    return () if third_party_verbose(log_level) else KNOWN_NOISE


def _node(plan: ClusterPlan, role: ChildRole, index: int, flags: list[str]) -> ChildSpec:
    """A node with fixed gRPC, metrics and KV-event ports (the router follows KV events for the
    cache-aware policy; a fixed port lets it reconnect to a restarted node)."""
    ports = Ports(grpc=free_port(), metrics=free_port(), kv_events=free_port())
    argv = [*_cli(), role.value, "--model", str(plan.model_dir), "--port", str(ports.grpc),
            "--metrics-port", str(ports.metrics), "--kv-events-port", str(ports.kv_events), *flags,
            *plan.role_flags(role)]
    return ChildSpec(f"{role.value}-{index}", role, tuple(argv), ports, tls=plan.tls.client() if plan.tls else None,
                     hidden=_hidden(plan.log_level))


def _router(plan: ClusterPlan, nodes: list[ChildSpec], index: int) -> ChildSpec:
    """Router ``index`` (``router``, or ``router-0``, ``router-1``, ... with several) on ``port + index``."""
    port = plan.router_ports[index]
    workers = [f for n in nodes for f in (f"--{n.role.value}", f"127.0.0.1:{n.ports.grpc}")]
    argv = [*_cli(), "router", "--model", str(plan.model_dir), "--host", plan.host, "--port", str(port),
            *workers, *(plan.tls.router_flags() if plan.tls else []), *plan.router_flags]
    ports = Ports(http=port, metrics=port)  # the router serves /metrics beside the API
    name = "router" if plan.routers == 1 else f"router-{index}"
    return ChildSpec(name, ChildRole.ROUTER, tuple(argv), ports, _reachable(plan.host))


def _reachable(host: str) -> str:
    """An address to reach a server listening on ``host`` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def l3_flags(plan: ClusterPlan, rpc_port: int) -> list[str]:
    """The nodes' L3 flags: Mooncake behind the master at ``rpc_port``, with the plan's extra config.
    Prefill and decode nodes of different TP sizes also write the objects each other's ranks read
    (``l3_tp_sizes``; ``docs/tp.md``), unless the config names them."""
    sizes = sorted({plan.prefill_tp, plan.decode_tp})
    l3 = {"global_segment_size": plan.l3_segment_bytes, **({"l3_tp_sizes": sizes} if len(sizes) > 1 else {}),
          **plan.l3_config, "master_server_address": f"127.0.0.1:{rpc_port}"}
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", json.dumps(l3)]
