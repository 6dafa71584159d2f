"""The ``tierserve`` console script: one subcommand per role, each in its own module of this
package. A command parses flags into typed config objects, then hands them to the role's entry
point; no argparse namespace travels further. Heavy modules (torch, Mooncake) load inside the
command functions, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tierserve.cli.bench import add_bench_commands
from tierserve.cli.decode import add_decode_args, cmd_decode
from tierserve.cli.model import add_model_commands
from tierserve.cli.prefill import add_prefill_args, cmd_prefill
from tierserve.cli.router import add_router_args, cmd_router
from tierserve.cli.serve import add_serve_args, cmd_serve
from tierserve.cli.up import add_up_args, cmd_up
from tierserve.core.logs import LOG_FORMAT, configure_logging, third_party_verbose
from tierserve.mooncake_env import show_mooncake_info


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.quiet_access_log, format=LOG_FORMAT, stream=sys.stderr)
    if third_party_verbose(args.log_level):
        show_mooncake_info()
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    # Common flags go on leaf parsers only: argparse lets a subparser's defaults overwrite a parent's.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    common.add_argument("--quiet-access-log", action="store_true", help="do not log one line per HTTP request")
    parser = argparse.ArgumentParser(prog="tierserve", description="LLM serving with PD disaggregation "
                                     "and a three-tier KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_model_commands(sub.add_parser("model", help="manage models"), common)
    commands = (
        ("serve", "one engine behind an OpenAI-compatible HTTP API", add_serve_args, cmd_serve),
        ("up", "start a local cluster (L3 master, prefill and decode nodes, router)", add_up_args, cmd_up),
        ("prefill", "a prefill node (gRPC PrefillService)", add_prefill_args, cmd_prefill),
        ("decode", "a decode node (gRPC DecodeService)", add_decode_args, cmd_decode),
        ("router", "the OpenAI-compatible HTTP router over prefill/decode nodes", add_router_args, cmd_router),
    )
    for name, help_text, add_args, command in commands:
        p = sub.add_parser(name, help=help_text, parents=[common])
        add_args(p)
        p.set_defaults(func=command)
    add_bench_commands(sub.add_parser("bench", help="load generators, trace replay and performance reports"), common)
    return parser


if __name__ == "__main__":
    sys.exit(main())
