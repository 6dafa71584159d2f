"""``tierserve prefill``: a prefill node (gRPC ``PrefillService``)."""

from __future__ import annotations

import argparse
import logging
import sys

from tierserve.cli.node import add_node_args, run_role

log = logging.getLogger(__name__)


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    add_node_args(p)
    p.add_argument("--handoff-timeout", type=float, default=60.0,
                   help="seconds for prefill plus KV handoff when the request gives no deadline")


def cmd_prefill(args: argparse.Namespace) -> int:
    """Runs a prefill node; 2 for a bad fault file. Handoff faults come only from the tests' fault
    file (``TIERSERVE_TEST_FAULTS``, docs/faults.md), read here once: no flag turns them on."""
    from tierserve.transfer.faulty import injected_handoff_faults

    try:
        faults = injected_handoff_faults()
    except (ValueError, TypeError) as exc:
        print(f"tierserve prefill: {exc}", file=sys.stderr)
        return 2
    from tierserve.prefill_node.service import PrefillOptions, add_prefill_service
    from tierserve.proto import tierserve_pb2 as pb

    if faults.any:
        log.warning("test-only handoff faults from the tests' fault file: %s", faults)
    return run_role(args, pb.ROLE_PREFILL, add_prefill_service(PrefillOptions(args.handoff_timeout, faults)))
