"""Flags every node role shares (``prefill``, ``decode``): gRPC, metrics, KV events, transfer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tierserve.cli.flags import (
    add_engine_args,
    add_listen_args,
    add_model_args,
    add_tracing_args,
    node_engine_config,
    tracing_config,
)
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
    add_node_token_args(p)
    add_tracing_args(p)
    add_engine_args(p)


def add_node_token_args(p: argparse.ArgumentParser) -> None:
    """``--node-token`` or ``--node-token-file`` (nodes and the router; else $TIERSERVE_NODE_TOKEN)."""
    token = p.add_mutually_exclusive_group()
    token.add_argument("--node-token", help="shared secret every node RPC carries (prefer the file or "
                                            "$TIERSERVE_NODE_TOKEN: an argument shows in ps)")
    token.add_argument("--node-token-file", type=Path, help="file holding the node token (a Kubernetes secret)")
    p.add_argument("--handoff-integrity", action="store_true",
                   help="digest the KV handed from prefill to decode, per request and layer: prefill nodes "
                        "send the digests, decode nodes check them (a mismatch fails the request); both need it")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate: a node's to serve TLS, the router's for mutual TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", type=Path, help="PEM CA: nodes require client certificates it signed (mutual "
                                               "TLS); the router verifies nodes against it")


def node_options(args: argparse.Namespace) -> NodeOptions:
    from tierserve.core.node_auth import TLSFiles, read_token
    from tierserve.node.server import NodeOptions

    hostname = args.transfer_hostname or (args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1")
    return NodeOptions(host=args.host, port=args.port, transfer_hostname=hostname,
                       transfer_protocol=args.transfer_protocol, transfer_devices=args.transfer_device,
                       handoff_staging_bytes=max(0, args.handoff_staging_mb) << 20,
                       served_model_name=args.served_model_name, metrics_port=args.metrics_port,
                       kv_events_port=args.kv_events_port, log_level=args.log_level,
                       node_token=read_token(args.node_token, args.node_token_file),
                       tls=TLSFiles.of(args.tls_cert, args.tls_key, args.tls_ca),
                       handoff_integrity=args.handoff_integrity, tracing=tracing_config(args))


def run_role(args: argparse.Namespace, role: int, add_service: AddService, offload_generated: bool = False) -> int:
    """Runs a node of ``role`` (a ``pb.Role``) until SIGINT/SIGTERM; 2 for a usage error.
    ``offload_generated``: the engine's continuous offload (``EngineConfig``), for decode nodes."""
    from dataclasses import replace

    from tierserve.node.server import run_node

    config = node_engine_config(args)
    if config is None:
        return 2
    if config.speculative_draft_model_path is not None:
        from tierserve.engine.spec.draft_pools import draft_problem

        if (problem := draft_problem(config)) is not None:
            print(f"tierserve: {problem}", file=sys.stderr)
            return 2
    run_node(replace(config, offload_generated=offload_generated), node_options(args), role, add_service)
    return 0
