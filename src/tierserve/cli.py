"""The ``tierserve`` console script: one subcommand per role.

Subcommands parse flags into typed config objects in one small function each, then hand those
objects to the role's entry point; no argparse namespace travels further than that.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# Only the light config module here: torch loads when a command needs it, so --help stays fast.
from tierserve.cache.options import HostLayout, IOBackend, PrefetchPolicy, WritePolicy
from tierserve.engine.config import EngineConfig, HiCacheOptions

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("tierserve")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if args.quiet_access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    # Common flags go on leaf parsers only: argparse lets a subparser's defaults overwrite a parent's.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    common.add_argument("--quiet-access-log", action="store_true", help="do not log one line per HTTP request")
    parser = argparse.ArgumentParser(prog="tierserve", description="LLM serving with PD disaggregation "
                                     "and a three-tier KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    fetch = model_sub.add_parser("fetch", help="convert the built-in model into the local cache",
                                 parents=[common])
    fetch.add_argument("--cache-dir", type=Path, help="models directory (default: ~/.cache/tierserve/models)")
    fetch.set_defaults(func=cmd_model_fetch)

    serve = sub.add_parser("serve", help="one engine behind an OpenAI-compatible HTTP API", parents=[common])
    add_server_args(serve)
    serve.add_argument("--model", type=Path, help="Hugging Face model folder (default: the built-in model)")
    serve.set_defaults(func=cmd_serve)

    up = sub.add_parser("up", help="start a local cluster (L3 master, prefill and decode nodes, router)",
                        parents=[common])
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    prefill = sub.add_parser("prefill", help="a prefill node (gRPC PrefillService)", parents=[common])
    add_node_args(prefill)
    prefill.add_argument("--handoff-timeout", type=float, default=60.0,
                         help="seconds for prefill plus KV handoff when the request gives no deadline")
    prefill.add_argument("--fault-transfer-rate", type=float, default=0.0,
                         help="testing only: make this share of KV handoffs fail for real")
    prefill.set_defaults(func=cmd_prefill)

    decode = sub.add_parser("decode", help="a decode node (gRPC DecodeService)", parents=[common])
    add_node_args(decode)
    decode.add_argument("--lease-seconds", type=float, default=30.0,
                        help="how long a reservation waits for Generate before its pages are reclaimed")
    decode.add_argument("--reserve-decode-tokens", type=int, default=256,
                        help="pages reserved beyond the prompt for the first answer tokens")
    decode.add_argument("--reservation-grace", type=float, default=40.0,
                        help="seconds pages of an abandoned reservation stay unused (> any handoff timeout)")
    decode.set_defaults(func=cmd_decode)

    router = sub.add_parser("router", help="the OpenAI-compatible HTTP router over prefill/decode nodes",
                            parents=[common])
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    from tierserve.bench.cli import add_bench_commands  # argparse only: the client loads when it runs

    bench = sub.add_parser("bench", help="load generators, trace replay and performance reports")
    add_bench_commands(bench, common)
    return parser


def add_server_args(p: argparse.ArgumentParser) -> None:
    """HTTP and engine flags, named as in SGLang where it has one."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the API routes")
    p.add_argument("--admin-api-key", help="enable the /admin routes (L3 attach/detach/status/clear) with this key")
    p.add_argument("--served-model-name", help="model name in the API (default: the model folder's name)")
    add_engine_args(p)


def add_node_args(p: argparse.ArgumentParser) -> None:
    """gRPC, transfer and engine flags of a prefill or decode node."""
    from tierserve.transfer.options import TransferProtocol

    p.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port, logged)")
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the built-in model)")
    p.add_argument("--served-model-name", help="model name reported by Info (default: the model folder's name)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--kv-events-port", type=int,
                   help="publish KV events (ZMQ PUB) on this port for cache-aware routing (0: any free port)")
    p.add_argument("--transfer-protocol", type=TransferProtocol, default=TransferProtocol.TCP,
                   choices=list(TransferProtocol), metavar="{tcp,rdma}", help="KV transfer engine protocol")
    p.add_argument("--transfer-device", default="", help="RDMA device list for --transfer-protocol rdma")
    p.add_argument("--transfer-hostname", help="address peers use for this node's transfer engine "
                   "(default: --host, or 127.0.0.1 when that is 0.0.0.0)")
    add_engine_args(p)


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``tierserve router``, named as in SGLang's router where it has one."""
    from tierserve.router.policies import PolicyKind

    names = "{" + ",".join(k.value for k in PolicyKind) + "}"
    policies = {"type": PolicyKind, "choices": list(PolicyKind), "metavar": names}
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    workers = {"action": "extend", "nargs": "+", "default": [], "metavar": "HOST:PORT"}
    p.add_argument("--prefill", help="prefill workers (gRPC)", **workers)
    p.add_argument("--decode", help="decode workers (gRPC)", **workers)
    p.add_argument("--model", type=Path, help="model folder for the tokenizer and chat template (default: built-in)")
    p.add_argument("--served-model-name", help="model name in the API (default: the model folder's name)")
    p.add_argument("--context-length", type=int, help="max prompt + output tokens (default: the model's)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the API routes")
    p.add_argument("--admin-api-key", help="enable the /workers admin routes with this key")
    p.add_argument("--prefill-policy", default=PolicyKind.CACHE_AWARE, **policies)
    p.add_argument("--decode-policy", default=PolicyKind.POWER_OF_TWO, **policies)
    p.add_argument("--max-running-requests", type=int, default=256, help="requests in flight through the router")
    p.add_argument("--max-queued-requests", type=int, default=1024, help="waiting beyond this gets 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of a prefill leg, seconds")
    p.add_argument("--max-retries", type=int, default=2, help="new pairs tried while nothing was streamed")
    p.add_argument("--health-check-interval", type=float, default=2.0, help="seconds between worker checks")
    p.add_argument("--service-discovery", action="store_true", help="find workers as Kubernetes pods")
    p.add_argument("--service-discovery-namespace", help="pods' namespace (default: the router's own)")
    p.add_argument("--prefill-selector", default="app=tierserve,role=prefill", help="label selector of prefill pods")
    p.add_argument("--decode-selector", default="app=tierserve,role=decode", help="label selector of decode pods")
    p.add_argument("--service-discovery-port", type=int, default=50051,
                   help="workers' gRPC port when the pod names no container port 'grpc'")


def router_config(args: argparse.Namespace, model_dir: Path):
    from tierserve.router.app import RouterConfig
    from tierserve.router.backend import RouterOptions

    return RouterConfig(
        model_dir=model_dir, prefill=args.prefill, decode=args.decode, served_model_name=args.served_model_name,
        context_length=args.context_length, api_key=args.api_key, admin_api_key=args.admin_api_key,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        options=RouterOptions(max_running=args.max_running_requests, max_queued=args.max_queued_requests,
                              timeout_s=args.request_timeout, max_retries=args.max_retries),
        health_check_interval_s=args.health_check_interval,
    )


def cmd_router(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    from tierserve.router.app import serve_router

    model_dir = args.model or _builtin_model()
    if not (model_dir / "config.json").is_file():
        print(f"tierserve: {model_dir} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    tasks = _discovery_tasks(args)
    serve_router(router_config(args, model_dir), args.host, args.port, tasks, on_ready)
    return 0


def _discovery_tasks(args: argparse.Namespace) -> list:
    if not args.service_discovery:
        return []
    from tierserve.router.discovery import kubernetes_task

    return [kubernetes_task(args.service_discovery_namespace, args.prefill_selector, args.decode_selector,
                            args.service_discovery_port)]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens")
    p.add_argument("--mem-fraction-static", type=float, default=0.85, help="GPU memory share for the KV pool")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="prompt tokens per step")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, help="max prompt + output tokens (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-radix-cache", action="store_true", help="do not reuse KV of shared prompt prefixes")
    add_hicache_args(p)


def add_hicache_args(p: argparse.ArgumentParser) -> None:
    """The host tier (L2) of the prefix cache, named as in SGLang."""
    p.add_argument("--enable-hierarchical-cache", action="store_true", help="add a host-memory tier (L2)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size as a multiple of the device pool")
    p.add_argument("--hicache-size", type=float, help="L2 size in GB (overrides --hicache-ratio)")
    p.add_argument("--hicache-write-policy", type=WritePolicy, default=WritePolicy.WRITE_THROUGH,
                   choices=list(WritePolicy), metavar="{" + ",".join(w.value for w in WritePolicy) + "}")
    p.add_argument("--hicache-write-threshold", type=int, default=2,
                   help="hits before write_through_selective copies a prefix to L2")
    p.add_argument("--hicache-mem-layout", type=HostLayout, default=HostLayout.PAGE_FIRST_DIRECT,
                   choices=list(HostLayout), metavar="{" + ",".join(x.value for x in HostLayout) + "}")
    p.add_argument("--hicache-io-backend", type=IOBackend, default=IOBackend.KERNEL,
                   choices=list(IOBackend), metavar="{" + ",".join(x.value for x in IOBackend) + "}")
    p.add_argument("--hicache-storage-backend", choices=["file", "mooncake", "dynamic"], help="the shared L3 tier")
    p.add_argument("--hicache-storage-backend-extra-config", type=json.loads, default={}, metavar="JSON",
                   help='backend settings, e.g. {"path": "/cache"}, and prefetch_threshold / prefetch_timeout_*')
    p.add_argument("--hicache-storage-prefetch-policy", type=PrefetchPolicy, default=PrefetchPolicy.BEST_EFFORT,
                   choices=list(PrefetchPolicy), metavar="{" + ",".join(x.value for x in PrefetchPolicy) + "}")


def engine_config(args: argparse.Namespace, model_dir: Path) -> EngineConfig:
    """The engine settings from parsed flags."""
    return EngineConfig(
        model_dir=model_dir, device=args.device, dtype=args.dtype, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size, max_running_requests=args.max_running_requests,
        max_model_len=args.context_length, seed=args.seed, disable_radix_cache=args.disable_radix_cache,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache=HiCacheOptions(
            ratio=args.hicache_ratio, size_gb=args.hicache_size, write_policy=args.hicache_write_policy,
            write_threshold=args.hicache_write_threshold, mem_layout=args.hicache_mem_layout,
            io_backend=args.hicache_io_backend, storage_backend=args.hicache_storage_backend,
            storage_config=args.hicache_storage_backend_extra_config,
            prefetch_policy=args.hicache_storage_prefetch_policy,
        ),
    )


def cmd_model_fetch(args: argparse.Namespace) -> int:
    from tierserve.model.fetch import fetch_builtin_model

    log.info("fetching the built-in model")
    print(fetch_builtin_model(cache_dir=args.cache_dir, progress=True))
    return 0


def cmd_serve(args: argparse.Namespace, on_ready: Callable[[], None] | None = None) -> int:
    from tierserve.engine.server import serve

    model_dir = args.model or _builtin_model()
    if not (model_dir / "config.json").is_file():
        print(f"tierserve: {model_dir} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    try:
        config = engine_config(args, model_dir)
    except ValueError as exc:  # a flag out of range: a usage error, not a crash
        print(f"tierserve: {exc}", file=sys.stderr)
        return 2
    serve(config, args.host, args.port, args.api_key, model_name=args.served_model_name, on_ready=on_ready,
          admin_api_key=args.admin_api_key)
    return 0


def node_options(args: argparse.Namespace):
    from tierserve.node.server import NodeOptions

    hostname = args.transfer_hostname or (args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1")
    return NodeOptions(host=args.host, port=args.port, transfer_hostname=hostname,
                       transfer_protocol=args.transfer_protocol, transfer_devices=args.transfer_device,
                       served_model_name=args.served_model_name, metrics_port=args.metrics_port,
                       kv_events_port=args.kv_events_port)


def _node_config(args: argparse.Namespace) -> EngineConfig | None:
    model_dir = args.model or _builtin_model()
    if not (model_dir / "config.json").is_file():
        print(f"tierserve: {model_dir} is not a model folder (no config.json)", file=sys.stderr)
        return None
    try:
        return engine_config(args, model_dir)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return None


def cmd_prefill(args: argparse.Namespace) -> int:
    from tierserve.node.server import run_node
    from tierserve.prefill_node.service import add_prefill_service
    from tierserve.proto import tierserve_pb2 as pb

    config = _node_config(args)
    if config is None:
        return 2
    run_node(config, node_options(args), pb.ROLE_PREFILL,
             add_prefill_service(args.handoff_timeout, args.fault_transfer_rate))
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tierserve.decode_node.service import add_decode_service
    from tierserve.node.server import run_node
    from tierserve.proto import tierserve_pb2 as pb

    config = _node_config(args)
    if config is None:
        return 2
    config = replace(config, reserve_decode_tokens=args.reserve_decode_tokens,
                     reservation_grace_s=args.reservation_grace)
    run_node(config, node_options(args), pb.ROLE_DECODE, add_decode_service(args.lease_seconds))
    return 0


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--model", type=Path, help="Hugging Face model folder (default: the built-in model)")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--no-l3", action="store_true", help="no mooncake_master: nodes keep L1 (and L2 if asked) only")
    from tierserve.router.policies import PolicyKind

    names = "{" + ",".join(k.value for k in PolicyKind) + "}"
    p.add_argument("--prefill-policy", type=PolicyKind, choices=list(PolicyKind), metavar=names,
                   default=PolicyKind.CACHE_AWARE)
    p.add_argument("--decode-policy", type=PolicyKind, choices=list(PolicyKind), metavar=names,
                   default=PolicyKind.POWER_OF_TWO)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the router's API")
    p.add_argument("--admin-api-key", help="enable the router's /workers admin routes with this key")
    add_engine_args(p)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags the user set, as command-line arguments for every node."""
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_args(reference)
    flags: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if isinstance(value, bool):
            flags.append(action.option_strings[0])
        else:
            text = json.dumps(value) if isinstance(value, dict) else getattr(value, "value", value)
            flags += [action.option_strings[0], str(text)]
    return flags


def cmd_up(args: argparse.Namespace) -> int:
    from tierserve.launch import ClusterPlan, up

    model_dir = args.model or _builtin_model()
    router_flags = [f for flag, value in (("--api-key", args.api_key), ("--admin-api-key", args.admin_api_key))
                    if value for f in (flag, value)]
    router_flags += ["--prefill-policy", args.prefill_policy.value, "--decode-policy", args.decode_policy.value]
    plan = ClusterPlan(model_dir, args.host, args.port, args.prefill_nodes, args.decode_nodes, not args.no_l3,
                       _engine_flags(args), router_flags)

    def announce(base: str) -> None:
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\ntierserve is up: {base}/v1  ({args.prefill_nodes} prefill, {args.decode_nodes} decode"
              f"{', L3 on Mooncake' if not args.no_l3 else ''}; Ctrl+C stops it)\n\n"
              f"curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
              """  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], """
              """"max_tokens": 32}'\n""", flush=True)

    return up(plan, announce)


def _builtin_model() -> Path:
    from tierserve.model.fetch import builtin_model_dir, fetch_builtin_model, is_complete

    if not is_complete(builtin_model_dir()):
        log.info("converting the built-in model (once)")
    return fetch_builtin_model(progress=True)


if __name__ == "__main__":
    sys.exit(main())
