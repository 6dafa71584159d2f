"""Starts a node: its ranks (one process each; this one is rank 0), the engine on its own thread, a
transfer engine with the KV pool registered on every rank, and on rank 0 a gRPC server with the
role's service, ``NodeService`` and the standard health service."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierserve.cache.events import KVEventPublisher
from tierserve.core.gc_heap import freeze_startup_heap
from tierserve.core.kv_events_auth import CurveKeys
from tierserve.core.node_auth import TLSFiles, server_interceptors
from tierserve.core.transfer import TransferProtocol
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.engine.procs.spawn import RankProcesses
from tierserve.engine.procs.step_bus import LeaderBus
from tierserve.model.parallel import misfit
from tierserve.node.kv_events import advertised_endpoint, start_kv_events
from tierserve.node.metrics import NodeMetrics
from tierserve.node.rank_transfer import NodeRankRole, RankTransfer, Side, TransferOptions
from tierserve.node.service import NodeServicer
from tierserve.node.sessions import RouterSessions
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.tracing import NO_TRACER, Tracer, TracingConfig, start_tracing
from tierserve.transfer.engine import PeerEngines, TransferEngineHandle

log = logging.getLogger(__name__)
HEALTH_POLL_S = 0.25  # how often gRPC health reads the engine's (``EngineLoop.healthy``: a step overdue)
# HTTP/2 pings to every caller: a router whose host vanished without a TCP reset loses its connection,
# so its sessions end and its requests are freed, within 15 s (``node/sessions.py``), not TCP's minutes.
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.http2.max_pings_without_data", 0)]


@dataclass(frozen=True)
class NodeOptions:
    """Where a node listens (gRPC) and how its transfer engines reach peers."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (logged)
    transfer_hostname: str = "127.0.0.1"  # the address peers use for this node's transfer engines
    transfer_protocol: TransferProtocol = TransferProtocol.TCP
    transfer_devices: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"
    handoff_staging_bytes: int = 64 << 20  # per rank (transfer/staging.py); 0: none
    served_model_name: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics on this port; None = off
    kv_events_port: int | None = None  # ZMQ PUB of KV events on this port (0: any free); None = off
    log_level: str = "info"  # of ranks 1..N-1
    node_token: str | None = None  # every RPC but health must carry it (core/node_auth.py); None: open
    tls: TLSFiles | None = None  # serve TLS (mutual with a CA); None: plaintext
    handoff_integrity: bool = False  # digests of handed-over KV (transfer/digest.py): sent, or checked
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OTLP traces (docs/tracing.md); default: off

    def transfer(self) -> TransferOptions:
        return TransferOptions(self.transfer_hostname, self.transfer_protocol, self.transfer_devices,
                               self.handoff_staging_bytes, self.handoff_integrity)


@dataclass
class Node:
    """What a role's service needs. ``ranks``: every rank's transfer side, this rank's own;
    ``drain``: what the role's service does on SIGTERM before the server stops (decode: migrate);
    ``sessions``: the routers' sessions and the requests each made (``node/sessions.py``);
    ``tracer``: the spans of the calls it serves (``docs/tracing.md``)."""

    engine: Engine
    loop: EngineLoop
    transfer: TransferEngineHandle  # receives (decode) and names this node to peers
    peers: PeerEngines  # sends (prefill): one engine per destination
    metrics: NodeMetrics
    kv_events: KVEventPublisher | None = None
    ranks: RankTransfer | None = None
    drain: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    sessions: RouterSessions = field(default_factory=RouterSessions)
    tracer: Tracer = NO_TRACER


AddService = Callable[[grpc.aio.Server, Node], str]  # registers the role's servicer; returns its full name


def run_node(config: EngineConfig, options: NodeOptions, role: pb.Role, add_service: AddService) -> None:
    """Builds the node (``config.num_ranks`` rank processes: TP x PP, or CP; this one rank 0) and
    serves until SIGINT or SIGTERM; exits with status 2 for sizes the model cannot be split over, and
    status 1 when another rank dies (``docs/ranks.md``)."""
    import uvloop

    _check_fits(config)
    side = NodeRankRole(Side.PREFILL if role == pb.ROLE_PREFILL else Side.DECODE, options.transfer())
    procs = RankProcesses(config, options.log_level, side) if config.num_ranks > 1 else None
    try:
        engine = Engine(config, ranks=procs.join() if procs else None)
        ranks = side.start(engine)
    except BaseException:
        if procs is not None:
            procs.stop(grace_s=0)  # they wait for rank 0, which will never send them anything
        raise
    node = None
    try:
        node = _start(engine, ranks, options, procs, role)
        uvloop.run(_serve(node, options, role, add_service))
    finally:
        _stop(node, engine, procs)


def _start(engine: Engine, ranks: RankTransfer, options: NodeOptions, procs: RankProcesses | None, role: pb.Role
           ) -> Node:
    kv_events = None
    if options.kv_events_port is not None:  # before the engine thread starts: the tree is its alone then
        curve = CurveKeys.from_token(options.node_token) if options.node_token else None
        kv_events = start_kv_events(engine, f"tcp://{options.host}:{options.kv_events_port}", curve=curve)
    loop = EngineLoop(engine, LeaderBus(engine.ranks, procs.fail) if procs else None,
                      procs.watch() if procs else None)
    service = "tierserve-" + pb.Role.Name(role).removeprefix("ROLE_").lower()
    tracer = start_tracing(options.tracing, service, f"{options.host}:{options.port}")
    node = Node(engine, loop.start(), ranks.receiver, ranks.peers, NodeMetrics(loop), kv_events, ranks, tracer=tracer)
    node.metrics.watch(node.sessions)
    if options.metrics_port is not None:
        node.metrics.serve(options.host, options.metrics_port)
    return node


def _stop(node: Node | None, engine: Engine, procs: RankProcesses | None) -> None:
    """Stops the engine thread (which tells the other ranks to stop), the ranks, the L2/L3 workers."""
    if node is not None:
        node.loop.stop()
        if node.kv_events is not None:
            node.kv_events.stop()
    if procs is not None:
        procs.stop()
    engine.cache.close()


def _check_fits(config: EngineConfig) -> None:
    """Refuses, before any process starts, a TP size the model's heads or MLP cannot be split over, a
    PP size above its layers or a layer partition that does not add up to them (any TP x CP x PP
    runs on both roles, docs/cp.md)."""
    problem = misfit(config.model_dir, config.tp_size, config.pp_size, config.pp_layer_partition)
    if problem is not None:
        print(f"tierserve: {config.layout_flags} does not fit {config.model_dir.name}: {problem}", file=sys.stderr)
        raise SystemExit(2)


async def _serve(node: Node, options: NodeOptions, role: pb.Role, add_service: AddService) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *KEEPALIVE],
                             interceptors=server_interceptors(options.node_token))
    service_name = add_service(server, node)
    model_name = options.served_model_name or node.engine.config.model_dir.name
    events = advertised_endpoint(node.kv_events.endpoint, options.transfer_hostname) if node.kv_events else ""
    pb_grpc.add_NodeServiceServicer_to_server(
        NodeServicer(node.loop, role, node.transfer.endpoint, model_name, node.kv_events, events, node.sessions),
        server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    port = server.add_secure_port(address, options.tls.server_credentials()) if options.tls is not None \
        else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {options.host}:{options.port}")
    await server.start()
    freeze_startup_heap()  # before the first request (docs/architecture.md, the collector)
    names = ("", service_name, "tierserve.v1.NodeService")
    await _set_health(health_servicer, names, serving=True)
    follow = asyncio.create_task(_follow_engine(node.loop, health_servicer, names))
    log.info("%s node ready: grpc=%s:%d transfer=%s namespace=%s", pb.Role.Name(role).removeprefix("ROLE_").lower(),
             options.host, port, node.transfer.endpoint, node.engine.namespace.digest())
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: refusing new work, draining for up to 5 s")
    follow.cancel()
    await health_servicer.enter_graceful_shutdown()
    for drain in node.drain:
        await drain()
    await server.stop(grace=5)


async def _set_health(servicer: health.aio.HealthServicer, names: tuple[str, ...], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in names:
        await servicer.set(name, status)


async def _follow_engine(loop: EngineLoop, servicer: health.aio.HealthServicer, names: tuple[str, ...]) -> None:
    """gRPC health says what HTTP ``/health`` says: NOT_SERVING while a step is overdue (a frozen rank,
    ``engine/step_watch.py``), so the router stops sending here within a health check, SERVING again
    once it ended."""
    serving = True
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        if loop.healthy != serving:
            serving = not serving
            await _set_health(servicer, names, serving)
