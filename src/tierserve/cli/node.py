"""Flags every node role shares (``prefill``, ``decode``): gRPC, metrics, KV events, transfer."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from tierserve.cli.flags import add_engine_args, add_listen_args, add_model_args, node_engine_config
from tierserve.core.transfer import TransferProtocol

if TYPE_CHECKING:
    from tierserve.node.server import AddService, NodeOptions


def add_node_args(p: argparse.ArgumentParser) -> None:
    add_listen_args(p, 0, "gRPC")
    add_model_args(p)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--kv-events-port", type=int,
                   help="publish KV events (ZMQ PUB) on this port for cache-aware routing (0: any free port)")
    p.add_argument("--transfer-protocol", type=TransferProtocol, default=TransferProtocol.TCP,
                   choices=list(TransferProtocol), metavar="{tcp,rdma}", help="KV transfer engine protocol")
    p.add_argument("--transfer-device", default="", help="RDMA device list for --transfer-protocol rdma")
    p.add_argument("--handoff-staging-mb", type=int, default=64,
                   help="per rank: memory beside the KV pool that coalesces handoffs between TP sizes "
                        "(0: none; such handoffs then send one block per token)")
    p.add_argument("--transfer-hostname", help="address peers use for this node's transfer engine "
                   "(default: --host, or 127.0.0.1 when that is 0.0.0.0)")
    add_engine_args(p)


def node_options(args: argparse.Namespace) -> NodeOptions:
    from tierserve.node.server import NodeOptions

    hostname = args.transfer_hostname or (args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1")
    return NodeOptions(host=args.host, port=args.port, transfer_hostname=hostname,
                       transfer_protocol=args.transfer_protocol, transfer_devices=args.transfer_device,
                       handoff_staging_bytes=max(0, args.handoff_staging_mb) << 20,
                       served_model_name=args.served_model_name, metrics_port=args.metrics_port,
                       kv_events_port=args.kv_events_port, log_level=args.log_level)


def run_role(args: argparse.Namespace, role: int, add_service: AddService) -> int:
    """Runs a node of ``role`` (a ``pb.Role``) until SIGINT/SIGTERM; 2 for a usage error."""
    from tierserve.node.server import run_node

    config = node_engine_config(args)
    if config is None:
        return 2
    if config.speculative_draft_model_path is not None:
        from tierserve.engine.draft_pools import draft_problem

        if (problem := draft_problem(config)) is not None:
            print(f"tierserve: {problem}", file=sys.stderr)
            return 2
    run_node(config, node_options(args), role, add_service)
    return 0
