"""``tierserve up``: a local cluster (L3 master, prefill and decode nodes, router) in one command;
the nodes get the engine flags given here, rebuilt from the engine config."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from tierserve.cli.flags import add_engine_args, add_model_args, engine_config, engine_flags, model_dir
from tierserve.cli.router import add_policy_args
from tierserve.engine.config import EngineConfig


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    add_model_args(p, served_name=False)
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--no-l3", action="store_true", help="no mooncake_master: nodes keep L1 (and L2 if asked) only")
    add_policy_args(p)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the router's API")
    p.add_argument("--admin-api-key", help="enable the router's /workers admin routes with this key")
    add_engine_args(p)


def cmd_up(args: argparse.Namespace) -> int:
    from tierserve.launch import ClusterPlan, up

    folder = model_dir(args)
    if folder is None:
        return 2
    try:
        config = engine_config(args, folder)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return 2
    config, l3_config = (config, {}) if args.no_l3 else _without_l3_config(config)
    plan = ClusterPlan(folder, args.host, args.port, args.prefill_nodes, args.decode_nodes, not args.no_l3,
                       engine_flags(config), _router_flags(args), l3_config)
    return up(plan, lambda base: _announce(args, base))


def _without_l3_config(config: EngineConfig) -> tuple[EngineConfig, dict]:
    """The user's L3 extra config goes to ``up``, which adds the master's address to it."""
    return replace(config, hicache=replace(config.hicache, storage_config={})), config.hicache.storage_config


def _router_flags(args: argparse.Namespace) -> list[str]:
    keys = [f for flag, value in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key))
            if value for f in (flag, value)]
    return [*keys, "--prefill-policy", args.prefill_policy.value, "--decode-policy", args.decode_policy.value]


def _announce(args: argparse.Namespace, base: str) -> None:
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"\ntierserve is up: {base}/v1  ({args.prefill_nodes} prefill, {args.decode_nodes} decode"
          f"{', L3 on Mooncake' if not args.no_l3 else ''}; Ctrl+C stops it)\n\n"
          f"curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          """  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], """
          """"max_tokens": 32}'\n""", flush=True)
