"""``tierserve decode``: a decode node (gRPC ``DecodeService``); the reservation terms are this
role's own settings."""

from __future__ import annotations

import argparse
import sys

from tierserve.cli.node import add_node_args, run_role


def add_decode_args(p: argparse.ArgumentParser) -> None:
    add_node_args(p)
    p.add_argument("--lease-seconds", type=float, default=30.0,
                   help="how long a reservation waits for Generate before its pages are reclaimed")
    p.add_argument("--reserve-decode-tokens", type=int, default=256,
                   help="pages reserved beyond the prompt for the first answer tokens")
    p.add_argument("--max-lease-seconds", type=float, default=900.0,
                   help="the longest lease a Reserve may ask for (the router asks for its prefill deadline)")
    p.add_argument("--reservation-grace", type=float, default=40.0,
                   help="seconds pages of an abandoned reservation stay unused (> the transfer timeout)")


def cmd_decode(args: argparse.Namespace) -> int:
    from tierserve.decode_node.service import add_decode_service
    from tierserve.engine.reservations import ReservationTerms
    from tierserve.proto import tierserve_pb2 as pb

    problem = _deadline_problem(args)
    if problem is not None:
        print(f"tierserve: {problem}", file=sys.stderr)
        return 2
    terms = ReservationTerms(args.lease_seconds, args.reservation_grace, args.reserve_decode_tokens)
    return run_role(args, pb.ROLE_DECODE, add_decode_service(terms, args.max_lease_seconds), offload_generated=True)


def _deadline_problem(args: argparse.Namespace) -> str | None:
    """Settings that would break the deadline chain (``docs/faults.md``), or None."""
    from tierserve.mooncake_env import transfer_timeout_s

    transfer = transfer_timeout_s(args.transfer_protocol)
    if args.reservation_grace <= transfer:
        return (f"--reservation-grace {args.reservation_grace:g} must exceed the transfer timeout ({transfer:g} s): "
                "a batch in flight when its writer gave up may still land until then")
    if not 0 < args.lease_seconds <= args.max_lease_seconds:
        return f"--lease-seconds must be in (0, --max-lease-seconds {args.max_lease_seconds:g}]"
    return None
