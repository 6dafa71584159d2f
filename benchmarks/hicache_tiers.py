"""Hit rate and TTFT per cache tier set, on the whole cluster, with the same workload and seed.

Configurations (the built-in model on this machine, float32, CPU; every node's L1 is
``--l1-tokens``, small enough that the workload does not fit, as with 30K-200K-token contexts in
production):

    (a) L1 only                          1 prefill + 1 decode, router
    (b) L1 + L2                          + host tier (--hicache-ratio 2)
    (c) L1 + L2 + L3                     + Mooncake Store (a real mooncake_master)
    (d) L1 + L2 + L3, 2 prefill nodes    sharing the L3
    (e) one node, no disaggregation      `tierserve serve` with L1 + L2 + L3

Workload: ``tierserve bench``'s multi-turn chat (SGLang's HiCache benchmark shape): each client's
round sends the whole history plus a new question; the answer joins the history.

    .venv/bin/python benchmarks/hicache_tiers.py [--clients 8] [--rounds 4] [--l2-ratio 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierserve.bench import (
    BenchOptions,
    MultiTurnConfig,
    Report,
    TokenSpace,
    multiturn,
    plot_hit_rate,
    plot_ttft_cdf,
    run_bench,
)
from tierserve.launch import Cluster, free_port, grpc_serving, http_ok, tcp_open
from tierserve.model.fetch import fetch_builtin_model


@dataclass(frozen=True)
class Setup:
    name: str
    prefill_nodes: int = 1
    l2: bool = False
    l3: bool = False
    disaggregated: bool = True


SETUPS = [
    Setup("(a) L1 only"),
    Setup("(b) L1+L2", l2=True),
    Setup("(c) L1+L2+L3", l2=True, l3=True),
    Setup("(d) L1+L2+L3, 2 prefill", prefill_nodes=2, l2=True, l3=True),
    Setup("(e) one node, L1+L2+L3", l2=True, l3=True, disaggregated=False),
]


def wait(ready: Callable[[], bool], what: str, cluster: Cluster, deadline_s: float = 300) -> None:
    import time

    deadline = time.monotonic() + deadline_s
    while not ready():
        if (dead := cluster.dead()) is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start ({dead.name if dead else 'timeout'})")
        time.sleep(0.1)  # poll interval


def cache_flags(setup: Setup, cluster: Cluster, l2_ratio: float) -> list[str]:
    flags = ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    if setup.l2:
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", str(l2_ratio)]
    if setup.l3:
        rpc, metrics = free_port(), free_port()
        cluster.start("master", [str(Path(sys.executable).parent / "mooncake_master"), f"--rpc_port={rpc}",
                                 f"--metrics_port={metrics}"])
        wait(lambda: tcp_open(rpc), "mooncake_master", cluster)
        config = {"master_server_address": f"127.0.0.1:{rpc}", "global_segment_size": 512 << 20}
        # requests run one or two at a time here: best_effort would stop a prefetch at once
        flags += ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(config),
                  "--hicache-storage-prefetch-policy", "timeout"]
    return flags


def start(setup: Setup, model: Path, args: argparse.Namespace, cluster: Cluster) -> str:
    """Starts the setup's processes; returns the HTTP endpoint."""
    cli, flags, http = [sys.executable, "-m", "tierserve.cli"], cache_flags(setup, cluster, args.l2_ratio), free_port()
    l1_tokens = args.l1_tokens
    small_l1 = [*flags, "--max-total-tokens", str(l1_tokens)]
    if not setup.disaggregated:  # one pool for the prefix cache and the running requests: the two nodes' sum
        pool = l1_tokens + args.decode_tokens
        one_pool = [*flags, "--max-total-tokens", str(pool)]
        if setup.l2:  # the same L2 as the prefill node's, not a multiple of the bigger pool
            one_pool += ["--hicache-ratio", f"{l1_tokens * args.l2_ratio / pool:.4f}"]
        cluster.start("serve", [*cli, "serve", "--model", str(model), "--port", str(http), *one_pool])
        wait(lambda: http_ok(f"http://127.0.0.1:{http}/health"), "serve", cluster)
        return f"http://127.0.0.1:{http}"
    nodes = [("prefill", free_port(), small_l1) for _ in range(setup.prefill_nodes)]
    nodes.append(("decode", free_port(), [*flags, "--max-total-tokens", str(args.decode_tokens)]))
    for i, (role, port, node_flags) in enumerate(nodes):
        cluster.start(f"{role}-{i}", [*cli, role, "--model", str(model), "--port", str(port), "--kv-events-port", "0",
                                      *node_flags])
    for role, port, _ in nodes:
        wait(lambda p=port: grpc_serving(p), role, cluster)
    workers = [a for role, port, _ in nodes for a in (f"--{role}", f"127.0.0.1:{port}")]
    cluster.start("router", [*cli, "router", "--model", str(model), "--port", str(http), *workers,
                             "--log-level", "warning"])
    wait(lambda: http_ok(f"http://127.0.0.1:{http}/readiness"), "router", cluster)
    return f"http://127.0.0.1:{http}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8, help="conversations")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context", type=int, default=384, help="round 0's context tokens")
    parser.add_argument("--l1-tokens", type=int, default=1024, help="each prefill node's device KV pool")
    parser.add_argument("--l2-ratio", type=float, default=4.0, help="host tier size as a multiple of L1")
    parser.add_argument("--decode-tokens", type=int, default=4096, help="the decode node's KV pool")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/hicache_tiers"))
    args = parser.parse_args()
    model = fetch_builtin_model(progress=True)
    config = MultiTurnConfig(clients=args.clients, rounds=args.rounds, context_length=args.context,
                             question_length=48, output_length=16)
    reports: dict[str, Report] = {}
    for setup in SETUPS:
        cluster = Cluster()
        try:
            url = start(setup, model, args, cluster)
            workload = multiturn(config, style="chat", space=TokenSpace(), seed=0)
            reports[setup.name] = run_bench(url, workload, BenchOptions(mode="closed", clients=2, seed=0))
            print(f"{setup.name}: {_row(reports[setup.name])}", flush=True)
        finally:
            cluster.stop()
    report(reports, args)


def _row(report: Report) -> str:
    s = report.summary()
    tiers = s["hit_rate_by_tier"]
    return (f"| {s['hit_rate']:.2f} | {tiers['device']:.2f} / {tiers['host']:.2f} / {tiers['storage']:.2f} | "
            f"{s['ttft_s']['median']:.3f} | {s['ttft_s']['p90']:.3f} | {s['requests']['failed']} |")


def report(reports: dict[str, Report], args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for name, r in reports.items():
        r.to_json(args.out / f"{name.split()[0].strip('()')}.json")
    plot_ttft_cdf(reports, args.out / "ttft_cdf.png")
    plot_hit_rate(reports, args.out / "hit_rate.png")
    print(f"\n{args.clients} conversations x {args.rounds} rounds, L1 {args.l1_tokens} tokens per prefill node, "
          f"L2 {args.l2_ratio:g} x L1\n")
    print("| setup | hit rate | by tier: device / host / storage | TTFT median (s) | TTFT p90 (s) | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in reports.items():
        print(f"| {name} {_row(r)}")


if __name__ == "__main__":
    main()
