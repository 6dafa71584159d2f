"""``tierserve router``: the OpenAI-compatible HTTP router over prefill/decode nodes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tierserve.cli.flags import (
    add_admission_args,
    add_api_key_args,
    add_chat_args,
    add_listen_args,
    add_model_args,
    add_tracing_args,
    model_dir,
    tenant_keys,
    tracing_config,
)
from tierserve.cli.node import add_node_token_args

if TYPE_CHECKING:
    from tierserve.router.app import RouterConfig, Task


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """``--prefill-policy`` and ``--decode-policy`` (``tierserve router`` and ``up``)."""
    from tierserve.router.policies import PolicyKind

    names = "{" + ",".join(k.value for k in PolicyKind) + "}"
    policies = {"type": PolicyKind, "choices": list(PolicyKind), "metavar": names}
    p.add_argument("--prefill-policy", default=PolicyKind.CACHE_AWARE, **policies)
    p.add_argument("--decode-policy", default=PolicyKind.POWER_OF_TWO, **policies)


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    """``--disaggregation-threshold`` and ``--disaggregation-spill-priority`` (``tierserve router`` and ``up``)."""
    from tierserve.router.disaggregation import DEFAULT_THRESHOLD

    p.add_argument("--disaggregation-threshold", type=non_negative_tokens, default=DEFAULT_THRESHOLD,
                   metavar="TOKENS", help="a prompt with fewer tokens than this not cached on the picked decode "
                   f"node is prefilled there, without a prefill node (0: always through a prefill node; "
                   f"default {DEFAULT_THRESHOLD})")
    p.add_argument("--disaggregation-spill-priority", type=int, metavar="PRIORITY",
                   help="a request of this priority or a more important one (lower) is also prefilled on its decode "
                   "node when the prefill nodes are backed up: their predicted TTFT 1.5x the decode node's own, "
                   "which computes no prompt as important (default: never)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``tierserve router``, named as in SGLang's router where it has one."""
    add_listen_args(p, 8000)
    workers = {"action": "extend", "nargs": "+", "default": [], "metavar": "HOST:PORT"}
    p.add_argument("--prefill", help="prefill workers (gRPC)", **workers)
    p.add_argument("--decode", help="decode workers (gRPC)", **workers)
    add_model_args(p)
    p.add_argument("--context-length", type=int, help="max prompt + output tokens (default: the model's)")
    add_api_key_args(p, "the /workers admin routes")
    add_chat_args(p)
    add_policy_args(p)
    add_node_token_args(p)
    p.add_argument("--tls-server-name", metavar="NAME",
                   help="with TLS to the nodes: the name their certificates must carry, checked instead of the "
                        "address dialled (Kubernetes: one certificate for a fixed DNS name serves every pod IP)")
    p.add_argument("--max-running-requests", type=int, default=256, help="requests in flight through the router")
    p.add_argument("--max-queued-requests", type=int, default=1024, help="waiting beyond this gets 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of a prefill leg, seconds")
    p.add_argument("--max-retries", type=int, default=2, help="new pairs tried while the client has seen nothing")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="times a request whose decode node failed, went silent or drained mid-stream continues "
                        "on another pair (0: its stream ends with an error)")
    p.add_argument("--stream-idle-timeout", type=positive_seconds, default=30.0,
                   help="seconds a decode stream may send nothing before it is given up (retried if unseen)")
    add_disaggregation_args(p)
    add_admission_args(p)
    p.add_argument("--worker-drain-timeout", type=positive_seconds, default=600.0,
                   help="seconds a removed worker's running requests get to finish before its channel closes")
    p.add_argument("--health-check-interval", type=float, default=2.0, help="seconds between worker checks")
    p.add_argument("--service-discovery", action="store_true", help="find workers as Kubernetes pods")
    p.add_argument("--service-discovery-namespace", help="pods' namespace (default: the router's own)")
    p.add_argument("--prefill-selector", default="app=tierserve,role=prefill", help="label selector of prefill pods")
    p.add_argument("--decode-selector", default="app=tierserve,role=decode", help="label selector of decode pods")
    p.add_argument("--service-discovery-port", type=int, default=50051,
                   help="workers' gRPC port when the pod names no container port 'grpc'")
    add_tracing_args(p)


def positive_seconds(text: str) -> float:
    """An argparse type: a duration above 0 (0 would give every stream up at once)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, not {text}")
    return value


def non_negative_tokens(text: str) -> int:
    """An argparse type: a token count of 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more tokens, not {text}")
    return value


def router_config(args: argparse.Namespace, folder: Path) -> RouterConfig:
    from tierserve.core.node_auth import TLSFiles, read_token
    from tierserve.router.app import RouterConfig
    from tierserve.router.backend import RouterOptions

    return RouterConfig(
        model_dir=folder, prefill=args.prefill, decode=args.decode, served_model_name=args.served_model_name,
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        context_length=args.context_length, keys=tenant_keys(args), admin_api_key=args.admin_api_key,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, admission=args.admission,
        options=RouterOptions(max_running=args.max_running_requests, max_queued=args.max_queued_requests,
                              timeout_s=args.request_timeout, max_retries=args.max_retries,
                              stream_idle_timeout_s=args.stream_idle_timeout, max_migrations=args.max_migrations,
                              disaggregation_threshold=args.disaggregation_threshold,
                              disaggregation_spill_priority=args.disaggregation_spill_priority),
        health_check_interval_s=args.health_check_interval, drain_timeout_s=args.worker_drain_timeout,
        node_token=read_token(args.node_token, args.node_token_file),
        tls=TLSFiles.of(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name), tracing=tracing_config(args),
    )


def cmd_router(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    from tierserve.router.app import serve_router

    folder = model_dir(args)
    if folder is None:
        return 2
    try:
        config = router_config(args, folder)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return 2
    serve_router(config, args.host, args.port, _discovery_tasks(args), on_ready)
    return 0


def _discovery_tasks(args: argparse.Namespace) -> list[Task]:
    if not args.service_discovery:
        return []
    from tierserve.router.discovery import kubernetes_task

    return [kubernetes_task(args.service_discovery_namespace, args.prefill_selector, args.decode_selector,
                            args.service_discovery_port)]
