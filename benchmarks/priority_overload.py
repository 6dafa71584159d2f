"""Two priority classes under ~2x overload (docs/router.md, admission by deadline), through `tierserve up`
(one prefill and one decode node, no L3, always PD) on the built-in model (CPU), side by side in one run:

- ``fcfs``: nodes ``--schedule-policy fcfs``, router ``--admission fcfs`` (every request queued in arrival
  order, deadlines only counted);
- ``priority``: nodes ``--schedule-policy priority``, router ``--admission ttft`` (waiting work ordered by
  priority, less important work preempted, a request whose predicted TTFT is past its deadline shed with 429);
- ``spill``: ``priority`` and router ``--disaggregation-spill-priority 0``: a high request whose prefill node
  is backed up with high work is prefilled on the decode node, when it computes no high prompt itself.

The clusters run one at a time (the machine cannot hold two). First, on the first cluster, the capacity:
a closed loop of ``--clients`` clients, requests per second. Then, on each cluster: the high class alone,
one request at a time (its unloaded TTFT), the high class's own Poisson arrivals without the low class (its
TTFT alone: what it costs itself), and the overload: Poisson arrivals at ``--overload`` x that
capacity (the same rate and the same seeded prompts and classes for each), ``--high-share`` of them high
priority (0) with a deadline of ``--high-deadline`` x the unloaded p99 TTFT, the rest low priority (5) with
``--low-deadline`` x it (deadlines from the first cluster's unloaded run, the same for each). Every
prompt is fresh random token ids (no cache hits), ``--prompt`` tokens, ``--max-tokens`` new. Reported per
cluster and class: TTFT p50/p99, goodput (requests finished within their deadline per second), shed and late.

    .venv/bin/python benchmarks/priority_overload.py [--prompt 256] [--max-tokens 8] [--requests 240]
        [--overload 2] [--high-share 0.3] [--chunked-prefill-size 128] [--out /tmp/priority_overload.json]
        [--setups priority --rate R --deadlines-ms H,L]   # one setup alone, at another run's load
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from followup_l3 import Cluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.processes import stop  # noqa: E402

from tierserve.bench import BenchOptions, SharedPrefixConfig, TokenSpace, run_bench, shared_prefix  # noqa: E402
from tierserve.bench.classes import RequestClass  # noqa: E402
from tierserve.bench.report import Report  # noqa: E402

VOCAB = 49152  # the built-in model's
HIGH, LOW = 0, 5
SETUPS = {"fcfs": ["--schedule-policy", "fcfs", "--admission", "fcfs"],
          "priority": ["--schedule-policy", "priority", "--admission", "ttft"],
          "spill": ["--schedule-policy", "priority", "--admission", "ttft",
                    "--disaggregation-spill-priority", str(HIGH)]}


def workload(args: argparse.Namespace, n: int, seed: int) -> Any:
    """``n`` one-request sessions, each a fresh prompt (its own group: nothing shared)."""
    config = SharedPrefixConfig(groups=n, prompts_per_group=1, system_length=args.prompt - 16, question_length=16,
                                output_length=args.max_tokens)
    return shared_prefix(config, "tokens", TokenSpace(VOCAB, 32), seed)


def bench(url: str, args: argparse.Namespace, n: int, seed: int, **options: Any) -> Report:
    return run_bench(url, workload(args, n, seed), BenchOptions(progress=False, timeout_s=600, seed=seed, **options))


def capacity(url: str, args: argparse.Namespace) -> float:
    report = bench(url, args, args.capacity_requests, seed=1, mode="closed", clients=args.clients)
    return report.summary()["request_throughput"]


def unloaded(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The high class alone, one request at a time."""
    report = bench(url, args, args.unloaded_requests, seed=2, mode="closed", clients=1,
                   classes=(RequestClass(HIGH, 1.0),))
    return report.summary()["ttft_s"]


def high_alone(url: str, args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """The high class's own arrivals without the low class: Poisson at its share of the overload's rate,
    as many requests as it sends there. Its TTFT is what the high class costs itself (queueing behind its
    own arrivals and the step in flight), the value the overload is compared with in the second ratio."""
    n = max(1, round(args.requests * args.high_share))
    report = bench(url, args, n, seed=4, mode="poisson", rate=rate * args.high_share,
                   classes=(RequestClass(HIGH, 1.0),))
    return report.summary()["ttft_s"]


def overload(url: str, args: argparse.Namespace, rate: float, deadlines: tuple[int, int]) -> dict[str, Any]:
    classes = (RequestClass(HIGH, args.high_share, deadlines[0]), RequestClass(LOW, 1 - args.high_share, deadlines[1]))
    report = bench(url, args, args.requests, seed=3, mode="poisson", rate=rate, classes=classes)
    s = report.summary()
    return {"goodput": s["goodput"], "by_priority": s["by_priority"], "duration_s": s["duration_s"]}


def router_state(url: str) -> dict[str, Any]:
    """The router's retries (a busy decode node's waits among them), its tries per path, those spilled
    to the decode node, and its lanes at the end."""
    state = httpx.get(f"{url}/debug/state", timeout=10).json()
    return {key: state[key] for key in ("retries", "served", "spilled", "lanes")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunked-prefill-size", type=int, default=128,
                   help="the nodes' prefill budget per step (both setups): on CPU a step's time grows with it, and a "
                        "request arriving mid-step waits for that step whatever its priority")
    p.add_argument("--clients", type=int, default=8, help="capacity: closed-loop clients")
    p.add_argument("--capacity-requests", type=int, default=64)
    p.add_argument("--unloaded-requests", type=int, default=30)
    p.add_argument("--requests", type=int, default=240, help="overload: requests sent")
    p.add_argument("--overload", type=float, default=2.0, help="arrival rate over the measured capacity")
    p.add_argument("--high-share", type=float, default=0.3)
    p.add_argument("--high-deadline", type=float, default=3.0, help="x the unloaded p99 TTFT")
    p.add_argument("--low-deadline", type=float, default=10.0, help="x the unloaded p99 TTFT")
    p.add_argument("--rate", type=float, help="the overload's arrivals per second (default: --overload x the "
                                               "capacity, measured first)")
    p.add_argument("--deadlines-ms", help="high,low deadlines in ms (default: from the first setup's unloaded p99)")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help="comma-separated setups to run, in this order (the first one measures the capacity)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="priority_overload-"))
    results: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "logs": str(logs)}
    if args.rate:  # another run's load, to repeat it as it was
        results["rate"] = args.rate
    if args.deadlines_ms:
        results["deadlines_ms"] = [int(v) for v in args.deadlines_ms.split(",")]
    for name in args.setups.split(","):
        flags = SETUPS[name]
        node_flags = ["--no-l3", "--chunked-prefill-size", str(args.chunked_prefill_size)]
        cluster = Cluster(name, ROOT / "src", logs, [*node_flags, *flags], {})
        try:
            cluster.wait_ready()
            bench(cluster.url, args, 4, seed=0, mode="closed", clients=1)  # warm-up, outside the timing
            if "rate" not in results:
                results["capacity_rps"] = capacity(cluster.url, args)
                results["rate"] = args.overload * results["capacity_rps"]
            base = unloaded(cluster.url, args)
            if "deadlines_ms" not in results:
                factors = (args.high_deadline, args.low_deadline)
                results["deadlines_ms"] = [round(base["p99"] * 1000 * k) for k in factors]
            alone = high_alone(cluster.url, args, results["rate"])
            results[name] = {"unloaded_ttft_s": base, "high_alone_ttft_s": alone,
                             "overload": overload(cluster.url, args, results["rate"], tuple(results["deadlines_ms"])),
                             "router": router_state(cluster.url)}
            print(name, json.dumps(results[name], indent=1), flush=True)
        finally:
            stop(cluster.proc)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def table(r: dict[str, Any]) -> str:
    lines = [f"capacity {r.get('capacity_rps', float('nan')):.2f} req/s; offered {r['rate']:.2f} req/s; "
             f"deadlines (ms) high {r['deadlines_ms'][0]}, low {r['deadlines_ms'][1]}",
             "| setup | unloaded high TTFT p50 / p99 (s) | high alone TTFT p50 / p99 (s) | high TTFT p50 / p99 (s) | "
             "high p99 / unloaded p99 | high p99 / alone p99 | low TTFT p50 / p99 (s) | goodput (req/s) | "
             "high good / shed / late | low good / shed / late | router retries |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for name in [n for n in SETUPS if n in r]:
        u, o = r[name]["unloaded_ttft_s"], r[name]["overload"]
        alone = r[name].get("high_alone_ttft_s", {})
        high, low = o["by_priority"].get(HIGH, {}), o["by_priority"].get(LOW, {})
        lines.append(f"| {name} | {u['median']:.3f} / {u['p99']:.3f} | {_ttft({'ttft_s': alone})} | {_ttft(high)} | "
                     f"{_ratio(high, u)} | {_ratio(high, alone) if alone else '-'} | {_ttft(low)} | "
                     f"{o['goodput']['goodput']:.2f} | {_counts(high)} | "
                     f"{_counts(low)} | {r[name].get('router', {}).get('retries', '-')} |")
    return "\n".join(lines)


def _ttft(c: dict[str, Any]) -> str:
    t = c.get("ttft_s") or {}
    return "-" if t.get("median") is None else f"{t['median']:.3f} / {t['p99']:.3f}"


def _ratio(c: dict[str, Any], u: dict[str, Any]) -> str:
    t = c.get("ttft_s") or {}
    return "-" if t.get("p99") is None else f"{t['p99'] / u['p99']:.2f}"


def _counts(c: dict[str, Any]) -> str:
    return f"{c.get('good', 0)} / {c.get('shed', 0)} / {c.get('late', 0)} of {c.get('requests', 0)}"


if __name__ == "__main__":
    main()
