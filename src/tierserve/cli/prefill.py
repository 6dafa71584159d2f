"""``tierserve prefill``: a prefill node (gRPC ``PrefillService``)."""

from __future__ import annotations

import argparse

from tierserve.cli.node import add_node_args, run_role


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    add_node_args(p)
    p.add_argument("--handoff-timeout", type=float, default=60.0,
                   help="seconds for prefill plus KV handoff when the request gives no deadline")
    p.add_argument("--fault-transfer-rate", type=float, default=0.0,
                   help="testing only: make this share of KV handoffs fail for real")
    p.add_argument("--fault-transfer-delay", type=float, default=0.0,
                   help="testing only: hold each KV handoff's first batch this many seconds (a slow link)")
    p.add_argument("--fault-transfer-corrupt-rate", type=float, default=0.0,
                   help="testing only: make this share of KV handoffs write wrong bytes "
                        "(caught by --handoff-integrity)")


def cmd_prefill(args: argparse.Namespace) -> int:
    from tierserve.prefill_node.service import PrefillOptions, add_prefill_service
    from tierserve.proto import tierserve_pb2 as pb

    options = PrefillOptions(args.handoff_timeout, args.fault_transfer_rate, args.fault_transfer_delay,
                             args.fault_transfer_corrupt_rate)
    return run_role(args, pb.ROLE_PREFILL, add_prefill_service(options))
