"""``tierserve up``: a local cluster (L3 master, prefill and decode nodes, router) in one command;
the nodes get the engine flags given here, rebuilt from the engine config."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tierserve.cache.options import DraftLayout
from tierserve.cli.decode import add_decode_args
from tierserve.cli.flags import (
    add_admission_args,
    add_chat_args,
    add_engine_args,
    add_model_args,
    add_tracing_args,
    chat_flags,
    engine_config,
    engine_flags,
    model_dir,
    tenant_keys,
    tracing_config,
)
from tierserve.cli.prefill import add_prefill_args
from tierserve.cli.router import add_disaggregation_args, add_policy_args, add_router_args
from tierserve.core.layer_split import layer_partition
from tierserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from tierserve.launch.tls import ClusterTLS


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=int, default=8000, help="the router's port (the first router's with --routers)")
    p.add_argument("--routers", type=int, default=1,
                   help="routers in front of the same nodes (active-active: each balances on the load the nodes "
                        "report), on ports --port, --port + 1, ...")
    add_model_args(p, served_name=False)
    add_chat_args(p)
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--prefill-tp-size", type=int, default=1,
                   help="tensor-parallel ranks (processes; on CUDA one GPU each) of every prefill node")
    p.add_argument("--decode-tp-size", type=int, default=1,
                   help="tensor-parallel ranks of every decode node (any pairing with the prefill size works)")
    p.add_argument("--prefill-pp-size", type=int, default=1,
                   help="pipeline stages of every prefill node, each of --prefill-tp-size ranks")
    p.add_argument("--decode-pp-size", type=int, default=1,
                   help="pipeline stages of every decode node, each of --decode-tp-size ranks")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-pp-layer-partition", type=layer_partition, metavar="N,N,...",
                       help=f"layers of each pipeline stage of every {role} node (as --pp-layer-partition; "
                            "default: as even as can be, the extra layers on the stages before the last)")
    p.add_argument("--prefill-cp-size", type=int, default=1,
                   help="context-parallel ranks of every prefill node, each storing 1/N of the KV pages and "
                        "sending those to the decode node's owners of them")
    p.add_argument("--decode-cp-size", type=int, default=1,
                   help="context-parallel ranks of every decode node, each storing 1/N of the KV pages (any "
                        "pairing with the prefill layout works)")
    p.add_argument("--no-l3", action="store_true", help="no mooncake_master: nodes keep L1 (and L2 if asked) only")
    p.add_argument("--l3-size-gb", type=float, default=None,
                   help="the L3 store's size in GB, split evenly between the nodes (default: a third of this "
                        "machine's memory; segments take memory only as they fill)")
    add_policy_args(p)
    add_disaggregation_args(p)
    add_admission_args(p)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on the router's API")
    keys.add_argument("--api-keys", type=Path, metavar="FILE", help="the router's tenants' API keys (see router)")
    p.add_argument("--admin-api-key", help="enable the router's /workers admin routes with this key")
    p.add_argument("--handoff-integrity", action="store_true",
                   help="digest the KV handed from prefill to decode per request and layer, checked by the "
                        "decode node (both roles get the flag; see prefill --help)")
    p.add_argument("--tls", action="store_true",
                   help="node gRPC over mutual TLS: nodes serve it, the router presents a client certificate "
                        "(certificates from --tls-dir, made there with openssl where missing)")
    p.add_argument("--tls-dir", type=Path, help="with --tls: the certificates' folder (ca.pem, node.pem, node.key, "
                                                "client.pem, client.key; default: a new temporary folder)")
    p.add_argument("--state-file", type=Path,
                   help="keep the children's names, roles, PIDs and ports in this JSON file, rewritten whenever "
                        "one starts, dies or restarts (for scripts that watch or kill nodes)")
    p.add_argument("--restart-limit", type=int, default=5,
                   help="a child that dies this many times within --restart-window stops the whole cluster")
    p.add_argument("--restart-window", type=float, default=60.0, help="seconds; see --restart-limit")
    for role in ("prefill", "decode", "router"):
        p.add_argument(f"--{role}-args", type=shlex.split, default=[], metavar="'FLAGS'",
                       help=f"more flags for every {role} (one quoted string), e.g. "
                            + ("'--handoff-timeout 30'" if role == "prefill" else
                               "'--reservation-grace 60'" if role == "decode" else "'--max-running-requests 64'"))
    add_tracing_args(p)  # every node and the router, each its own service in the traces
    add_engine_args(p)


def cmd_up(args: argparse.Namespace) -> int:
    """Runs ``tierserve up`` until Ctrl-C; 2 for a usage error, 1 if the cluster failed."""
    from tierserve.launch import ClusterPlan, RestartPolicy, up

    folder = model_dir(args)
    if folder is None:
        return 2
    try:
        _node_only(args)
        _check_role_args(args)
        if args.routers < 1:
            raise ValueError("--routers must be at least 1")
        config = engine_config(args, folder)
        restart = RestartPolicy(max_deaths=args.restart_limit, window_s=args.restart_window)
        _check_sizes(args, config)
        config = _one_draft_layout(args, config)
        tenant_keys(args)  # a bad key file fails here, not in a router restarted until the crash limit
        tls = _tls(args)
    except ValueError as exc:
        print(f"tierserve: {exc}", file=sys.stderr)
        return 2
    config, l3_config = (config, {}) if args.no_l3 else _without_l3_config(config)
    integrity = ["--handoff-integrity"] if args.handoff_integrity else []
    segment = l3_size_bytes(args) // (args.prefill_nodes + args.decode_nodes)
    plan = ClusterPlan(folder, args.host, args.port, args.prefill_nodes, args.decode_nodes, not args.no_l3,
                       [*engine_flags(config), *_log_flags(args)],
                       [*_router_flags(args), *_log_flags(args), *args.router_args], l3_config, segment,
                       args.state_file, restart, [*integrity, *args.prefill_args], [*integrity, *args.decode_args],
                       args.prefill_tp_size,
                       args.decode_tp_size, args.prefill_pp_size, args.decode_pp_size, args.prefill_cp_size, tls,
                       args.prefill_pp_layer_partition, args.decode_pp_layer_partition, args.decode_cp_size,
                       args.routers, log_level=args.log_level)
    return up(plan, lambda base, children: _announce(args, base, children, tls))


def _tls(args: argparse.Namespace) -> ClusterTLS | None:
    """The cluster's certificates with ``--tls`` (made now: a failure is a usage error, not a crash loop)."""
    from tierserve.launch.tls import cluster_tls

    if not args.tls:
        if args.tls_dir is not None:
            raise ValueError("--tls-dir needs --tls")
        return None
    return cluster_tls(args.tls_dir or Path(tempfile.mkdtemp(prefix="tierserve-tls-")), args.host)


ROLE_PARSERS = {"prefill": add_prefill_args, "decode": add_decode_args, "router": add_router_args}


def _check_role_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming a ``--ROLE-args`` flag that role's parser does not know, so a typo or a
    removed flag (the test-only ``--fault-transfer-*``) stops ``up`` at once instead of crash-looping
    every child of that role until ``--restart-limit``."""
    for role, add_args in ROLE_PARSERS.items():
        parser = argparse.ArgumentParser(prog=f"tierserve {role}", add_help=False)
        add_args(parser)
        _, unknown = parser.parse_known_args(getattr(args, f"{role}_args"))
        if unknown:
            raise ValueError(f"--{role}-args: tierserve {role} does not take {' '.join(unknown)}")


def _node_only(args: argparse.Namespace) -> None:
    """``--pp-layer-partition`` names one node's stages: ``up`` takes it per role (``ValueError``)."""
    if args.pp_layer_partition is not None:
        raise ValueError("tierserve up: give the nodes' layer partitions with --prefill-pp-layer-partition and "
                         "--decode-pp-layer-partition")


def _check_sizes(args: argparse.Namespace, config: EngineConfig) -> None:
    """Each role's TP, PP and CP sizes, checked before any child starts (a node that cannot start
    would only be restarted until the crash-loop limit): ``ValueError`` saying why."""
    if config.speculative_draft_model_path is not None:
        from tierserve.engine.spec.draft_pools import draft_problem

        if (problem := draft_problem(config)) is not None:
            raise ValueError(problem)
    if config.tp_size != 1 or config.pp_size != 1 or config.cp_size != 1:
        raise ValueError("tierserve up: give the nodes' sizes with --prefill-tp-size, --decode-tp-size, "
                         "--prefill-cp-size, --decode-cp-size, --prefill-pp-size and --decode-pp-size")
    for role, sizes in (("prefill", RoleSizes(args.prefill_tp_size, args.prefill_pp_size, args.prefill_cp_size,
                                              args.prefill_pp_layer_partition)),
                        ("decode", RoleSizes(args.decode_tp_size, args.decode_pp_size, args.decode_cp_size,
                                             args.decode_pp_layer_partition))):
        if sizes != RoleSizes():
            _check_role(role, sizes, replace(config, enable_hierarchical_cache=True) if not args.no_l3 else config)


def _one_draft_layout(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """``config``, its draft's ``auto`` layout made the sidecar where the roles would resolve it
    differently (an EAGLE head's: packed at TP 1, the sidecar beside a tensor rank's share of the
    target's KV heads). Nodes of two layouts have two KV namespaces, so the router would refuse
    one role's nodes and never become ready; the sidecar runs at any layout."""
    from tierserve.engine.spec.draft_pools import draft_layout

    if config.speculative_draft_layout is not DraftLayout.AUTO:
        return config
    roles = {draft_layout(replace(config, tp_size=tp)) for tp in (args.prefill_tp_size, args.decode_tp_size)}
    return replace(config, speculative_draft_layout=DraftLayout.SIDECAR) if len(roles) > 1 else config


@dataclass(frozen=True)
class RoleSizes:
    """One role's rank counts: tensor ranks per stage, stages, context-parallel ranks, and the stages'
    layer counts (None: the default split)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    partition: tuple[int, ...] | None = None

    def flags(self, role: str) -> str:
        """As given on the command line, e.g. '--prefill-tp-size 1 --prefill-cp-size 2'."""
        more = [f"--{role}-{name}-size {n}" for name, n in (("pp", self.pp), ("cp", self.cp)) if n != 1]
        if self.partition is not None:
            more.append(f"--{role}-pp-layer-partition {','.join(map(str, self.partition))}")
        return " ".join([f"--{role}-tp-size {self.tp}", *more])


def _check_role(role: str, sizes: RoleSizes, config: EngineConfig) -> None:
    from tierserve.engine.spec.draft_pools import draft_problem
    from tierserve.model.parallel import misfit

    flags = sizes.flags(role)
    try:  # the config's own checks (e.g. a CP size below 1)
        sized = replace(config, tp_size=sizes.tp, pp_size=sizes.pp, cp_size=sizes.cp,
                        pp_layer_partition=sizes.partition)
    except ValueError as exc:
        raise ValueError(f"{flags}: {exc}") from None
    problem = misfit(config.model_dir, sizes.tp, sizes.pp, sizes.partition) or draft_problem(sized)
    if problem is not None:
        raise ValueError(f"{flags}: {problem}")


def l3_size_bytes(args: argparse.Namespace) -> int:
    """The whole L3 store. Its default is a third of physical memory because the store must hold
    the working set of backed-up prefixes: Mooncake's own 256 MiB per client evicted a
    conversation trace's prefixes before their follow-ups came (``benchmarks/RESULTS.md``,
    conversation trace replay), and a segment is committed only as objects fill it."""
    if args.l3_size_gb is not None:
        return int(args.l3_size_gb * 1e9)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 3


def _without_l3_config(config: EngineConfig) -> tuple[EngineConfig, dict]:
    """The user's L3 extra config goes to ``up``, which adds the master's address to it."""
    return replace(config, hicache=replace(config.hicache, storage_config={})), config.hicache.storage_config


def _log_flags(args: argparse.Namespace) -> list[str]:
    """``up``'s own logging and tracing settings, for every child: each child's lines go through
    ``up``'s stdout, so ``--quiet-access-log`` (no line per request) spares that hop too."""
    quiet = ["--quiet-access-log"] if args.quiet_access_log else []
    return ["--log-level", args.log_level, *quiet, *tracing_config(args).flags()]


def _router_flags(args: argparse.Namespace) -> list[str]:
    file = args.api_keys and args.api_keys.resolve()  # the router may run elsewhere than here
    keys = [str(f) for flag, value in (("--api-key", args.api_key), ("--api-keys", file),
                                       ("--admin-api-key", args.admin_api_key)) if value for f in (flag, value)]
    return [*keys, *chat_flags(args), "--prefill-policy", args.prefill_policy.value, "--decode-policy",
            args.decode_policy.value, "--disaggregation-threshold", str(args.disaggregation_threshold),
            "--admission", args.admission.value, *_spill_flags(args)]


def _spill_flags(args: argparse.Namespace) -> list[str]:
    spill = args.disaggregation_spill_priority
    return [] if spill is None else ["--disaggregation-spill-priority", str(spill)]


def _announce(args: argparse.Namespace, base: str, children: list[str], tls: ClusterTLS | None = None) -> None:
    """The banner: the API's URL, one line per child (role, port, metrics URL, PID), a request."""
    state = [f"  state file: {args.state_file}"] if args.state_file else []
    state += [f"  node gRPC over mutual TLS, certificates in {tls.folder}"] if tls else []
    print("\n".join(["", _headline(args, base), *children, *state, "", _example(args, base)]), flush=True)


def _headline(args: argparse.Namespace, base: str) -> str:
    l3 = "" if args.no_l3 else f", L3 on Mooncake: {l3_size_bytes(args) / 1e9:.1f} GB"
    more = f", {args.routers} routers on ports {args.port}-{args.port + args.routers - 1}" if args.routers > 1 else ""
    return (f"tierserve is up: {base}/v1  ({args.prefill_nodes} prefill"
            f"{_sizes(args.prefill_tp_size, args.prefill_pp_size, args.prefill_cp_size)}, {args.decode_nodes} decode"
            f"{_sizes(args.decode_tp_size, args.decode_pp_size, args.decode_cp_size)}{l3}{more}; "
            "Ctrl+C stops it; a child that dies is restarted)")


def _sizes(tp: int, pp: int, cp: int = 1) -> str:
    """The banner's sizes of a role: ' at TP 2', ' at PP 2', ' at CP 2', ' at TP 2 x PP 2', or '' at one rank."""
    parts = [f"{name} {size}" for name, size in (("TP", tp), ("PP", pp), ("CP", cp)) if size > 1]
    return f" at {' x '.join(parts)}" if parts else ""


def _example(args: argparse.Namespace, base: str) -> str:
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    return (f"curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            """  -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], """
            """"max_tokens": 32}'\n""")
