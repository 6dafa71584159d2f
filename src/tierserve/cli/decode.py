"""``tierserve decode``: a decode node (gRPC ``DecodeService``); the reservation terms are this
role's own settings."""

from __future__ import annotations

import argparse

from tierserve.cli.flags import node_engine_config
from tierserve.cli.node import add_node_args, node_options


def add_decode_args(p: argparse.ArgumentParser) -> None:
    add_node_args(p)
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="how long a reservation waits for Generate before its pages are reclaimed")
    p.add_argument("--reserve-decode-tokens", type=int, default=256,
                   help="pages reserved beyond the prompt for the first answer tokens")
    p.add_argument("--reservation-grace", type=float, default=40.0,
                   help="seconds pages of an abandoned reservation stay unused (> any handoff timeout)")


def cmd_decode(args: argparse.Namespace) -> int:
    from tierserve.decode_node.service import add_decode_service
    from tierserve.engine.reservations import ReservationTerms
    from tierserve.node.server import run_node
    from tierserve.proto import tierserve_pb2 as pb

    config = node_engine_config(args)
    if config is None:
        return 2
    terms = ReservationTerms(args.lease_seconds, args.reservation_grace, args.reserve_decode_tokens)
    run_node(config, node_options(args), pb.ROLE_DECODE, add_decode_service(terms))
    return 0
