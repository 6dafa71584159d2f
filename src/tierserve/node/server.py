"""Starts a node: the engine on its own thread, a transfer engine with the KV pool registered,
and a gRPC server with the role's service, ``NodeService`` and the standard health service."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierserve.cache.events import KVEventPublisher
from tierserve.core.transfer import TransferProtocol
from tierserve.engine.config import EngineConfig
from tierserve.engine.engine import Engine
from tierserve.engine.loop import EngineLoop
from tierserve.node.kv_events import advertised_endpoint, start_kv_events
from tierserve.node.metrics import NodeMetrics
from tierserve.node.service import NodeServicer
from tierserve.proto import tierserve_pb2 as pb
from tierserve.proto import tierserve_pb2_grpc as pb_grpc
from tierserve.transfer.engine import PeerEngines, TransferEngineHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeOptions:
    """Where a node listens (gRPC) and how its transfer engine reaches peers."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port (logged)
    transfer_hostname: str = "127.0.0.1"  # the address peers use for this node's transfer engine
    transfer_protocol: TransferProtocol = TransferProtocol.TCP
    transfer_devices: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"
    served_model_name: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics on this port; None = off
    kv_events_port: int | None = None  # ZMQ PUB of KV events on this port (0: any free); None = off


@dataclass
class Node:
    """What a role's service needs."""

    engine: Engine
    loop: EngineLoop
    transfer: TransferEngineHandle  # receives (decode) and names this node to peers
    peers: PeerEngines  # sends (prefill): one engine per destination
    metrics: NodeMetrics
    kv_events: KVEventPublisher | None = None


AddService = Callable[[grpc.aio.Server, Node], str]  # registers the role's servicer; returns its full name


def run_node(config: EngineConfig, options: NodeOptions, role: pb.Role, add_service: AddService) -> None:
    """Builds the node and serves until SIGINT or SIGTERM; exits with status 2 for a node of several
    ranks, which the prefill and decode roles do not run yet."""
    import uvloop

    _refuse_ranks(config, role)
    engine = Engine(config)
    transfer = TransferEngineHandle(options.transfer_hostname, options.transfer_protocol, options.transfer_devices)
    transfer.register(engine.pool.buffer)  # one arena: every page, every layer
    peers = PeerEngines(options.transfer_hostname, options.transfer_protocol, options.transfer_devices,
                        [engine.pool.buffer])
    kv_events = None
    if options.kv_events_port is not None:  # before the engine thread starts: the tree is its alone then
        kv_events = start_kv_events(engine, f"tcp://{options.host}:{options.kv_events_port}")
    loop = EngineLoop(engine)
    node = Node(engine, loop.start(), transfer, peers, NodeMetrics(loop), kv_events)
    if options.metrics_port is not None:
        node.metrics.serve(options.host, options.metrics_port)
    try:
        uvloop.run(_serve(node, options, role, add_service))
    finally:
        node.loop.stop()
        if node.kv_events is not None:
            node.kv_events.stop()
        engine.cache.close()  # stops the L2/L3 workers


def _refuse_ranks(config: EngineConfig, role: pb.Role) -> None:
    """Each rank would need its own transfer engine and head range in the KV handoff: a later stage
    of issue 14. Until then only ``tierserve serve`` runs several ranks."""
    if config.tp_size > 1:
        name = pb.Role.Name(role).removeprefix("ROLE_").lower()
        print(f"tierserve: --tp-size {config.tp_size}: {name} nodes run one rank only for now (the multi-rank "
              "KV handoff is not built yet); use --tp-size 1, or tierserve serve for tensor parallelism",
              file=sys.stderr)
        raise SystemExit(2)


async def _serve(node: Node, options: NodeOptions, role: pb.Role, add_service: AddService) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service_name = add_service(server, node)
    model_name = options.served_model_name or node.engine.config.model_dir.name
    events = advertised_endpoint(node.kv_events.endpoint, options.transfer_hostname) if node.kv_events else ""
    pb_grpc.add_NodeServiceServicer_to_server(
        NodeServicer(node.loop, role, node.transfer.endpoint, model_name, node.kv_events, events), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        raise OSError(f"cannot listen on {options.host}:{options.port}")
    await server.start()
    for name in ("", service_name, "tierserve.v1.NodeService"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s node ready: grpc=%s:%d transfer=%s namespace=%s", pb.Role.Name(role).removeprefix("ROLE_").lower(),
             options.host, port, node.transfer.endpoint, node.engine.namespace.digest())
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: refusing new work, draining for up to 5 s")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=5)
