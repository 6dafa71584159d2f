"""``tierserve bench run WORKLOAD ...`` and ``tierserve bench compare a.json b.json``.

Only argparse at import time: the console script builds this parser for every command, so the
client, the workloads and matplotlib load inside the command functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

WORKLOADS = ("multiturn", "shared-prefix", "trace", "azure")


def add_bench_commands(bench: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    """Adds ``run`` and ``compare`` under the ``bench`` parser; ``common`` holds the shared flags."""
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="drive an OpenAI-compatible endpoint with a workload", parents=[common])
    add_run_args(run)
    run.set_defaults(func=cmd_bench_run)
    cmp = sub.add_parser("compare", help="two report files side by side, with ratios b/a", parents=[common])
    cmp.add_argument("a", type=Path, help="baseline report (JSON from 'bench run --out')")
    cmp.add_argument("b", type=Path, help="report to compare with the baseline")
    cmp.add_argument("--plots-dir", type=Path, help="also write both runs' TTFT CDF and hit rate plots here")
    cmp.set_defaults(func=cmd_bench_compare)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("--endpoint", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON",
                   help='fields added to every request, e.g. {"cache_salt": "run1"}')
    p.add_argument("--seed", type=int, default=0, help="seeds prompts and Poisson arrivals")
    p.add_argument("--out", type=Path, help="write the report (every request) as JSON here")
    p.add_argument("--plots-dir", type=Path, help="write the TTFT CDF and hit rate PNGs here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--page-size", type=int, default=16,
                   help="the server's KV page size, for the ideal hit rate (tierserve's default: 16)")

    server = p.add_argument_group("the servers' view")
    server.add_argument("--scrape-metrics", action="store_true",
                        help="read the endpoint's /metrics (and the nodes', below) before and after the run and "
                             "add the servers' own figures to the report and plots: hit rate by tier, TTFT, "
                             "queue time, handoff time and bytes")
    server.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                        help="with --scrape-metrics: another server's /metrics, e.g. a node's (repeat the flag)")
    server.add_argument("--up-state", type=Path, metavar="FILE",
                        help="with --scrape-metrics: the nodes' /metrics URLs from this `tierserve up "
                             "--state-file` FILE")

    load = p.add_argument_group("load")
    load.add_argument("--mode", choices=["closed", "poisson", "trace"],
                      help="closed loop (--clients), Poisson arrivals (--rate) or the trace's times "
                           "(default: trace for trace/azure, closed otherwise)")
    load.add_argument("--clients", type=int, default=8, help="closed loop: requests in flight")
    load.add_argument("--rate", type=float, default=1.0, help="poisson: sessions started per second")
    load.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times (0.1: 10x faster)")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument("--barrier", action="store_true", help="multiturn: round r+1 waits for every round r")
    load.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    load.add_argument("--class", dest="classes", action="append", default=[], metavar="PRIORITY:SHARE[:DEADLINE_MS]",
                      help="a request class (repeat for a mix): that share of the sessions is sent with that "
                           "priority and first-token deadline (x-request-deadline-ms; also its SLO for goodput)")

    prompts = p.add_argument_group("prompts")
    prompts.add_argument("--style", choices=["tokens", "text", "chat"], default="tokens",
                         help="token ids or text to /v1/completions, or messages to /v1/chat/completions")
    prompts.add_argument("--vocab-size", type=int, default=49152, help="token ids stay below this (SmolLM2: 49152)")
    prompts.add_argument("--min-token-id", type=int, default=32, help="token ids stay at or above this (specials)")
    prompts.add_argument("--conversations", type=int, default=8, help="multiturn: number of conversations")
    prompts.add_argument("--rounds", type=int, default=4, help="multiturn: rounds per conversation")
    prompts.add_argument("--context-length", type=int, default=256, help="multiturn: round 0 context tokens")
    prompts.add_argument("--question-length", type=int, default=64, help="multiturn/shared-prefix: question tokens")
    prompts.add_argument("--output-length", type=int, default=32, help="multiturn/shared-prefix: max_tokens")
    prompts.add_argument("--groups", type=int, default=4, help="shared-prefix: groups")
    prompts.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group")
    prompts.add_argument("--system-length", type=int, default=512, help="shared-prefix: shared prompt tokens")

    trace = p.add_argument_group("trace / azure")
    trace.add_argument("--trace", type=Path, help="trace file (Mooncake jsonl or Azure csv)")
    trace.add_argument("--block-size", type=int, default=16, help="tokens per trace block of 512 (scales lengths)")
    trace.add_argument("--output-scale", type=float, help="output length factor (default: block-size / 512)")
    trace.add_argument("--max-records", type=int, help="replay only the first N records")
    trace.add_argument("--max-prompt-tokens", type=int, help="cut longer prompts to fit the model's context")


def build_workload(args: argparse.Namespace) -> Any:
    """The workload the flags describe. Raises ValueError for a bad combination."""
    from tierserve.bench import traces, workloads
    from tierserve.bench.tokens import TokenSpace

    space = TokenSpace(args.vocab_size, args.min_token_id)
    if args.workload == "multiturn":
        config = workloads.MultiTurnConfig(args.conversations, args.rounds, args.context_length,
                                           args.question_length, args.output_length)
        return workloads.multiturn(config, args.style, space, args.seed)
    if args.workload == "shared-prefix":
        sp = workloads.SharedPrefixConfig(args.groups, args.prompts_per_group, args.system_length,
                                          args.question_length, args.output_length)
        return workloads.shared_prefix(sp, args.style, space, args.seed)
    if args.trace is None:
        raise ValueError(f"the {args.workload} workload needs --trace FILE")
    if args.style != "tokens":
        raise ValueError("trace workloads send token ids: use --style tokens")
    tc = traces.TraceConfig(args.trace, args.block_size, args.output_scale, args.max_records, args.max_prompt_tokens)
    build = traces.mooncake_trace if args.workload == "trace" else traces.azure_trace
    return build(tc, space, args.seed)


def bench_options(args: argparse.Namespace) -> Any:
    from tierserve.bench.classes import RequestClass
    from tierserve.bench.runner import BenchOptions

    mode = args.mode or ("trace" if args.workload in ("trace", "azure") else "closed")
    return BenchOptions(mode=mode, clients=args.clients, rate=args.rate, time_scale=args.time_scale,
                        max_concurrency=args.max_concurrency, barrier=args.barrier, timeout_s=args.timeout,
                        seed=args.seed, progress=not args.no_progress, model=args.model, api_key=args.api_key,
                        extra_body=args.extra_body, page_size=args.page_size, metrics_urls=metrics_urls(args),
                        classes=tuple(RequestClass.parse(c) for c in args.classes))


def metrics_urls(args: argparse.Namespace) -> tuple[str, ...]:
    """The /metrics URLs to read (none without --scrape-metrics): the endpoint's, then the nodes'.
    Raises ValueError for node URLs without --scrape-metrics, OSError for an unreadable state file."""
    if not args.scrape_metrics:
        if args.metrics_url or args.up_state:
            raise ValueError("--metrics-url and --up-state need --scrape-metrics")
        return ()
    from tierserve.bench.server_metrics import metrics_url

    nodes = _up_state_urls(args.up_state) if args.up_state else []
    return tuple(dict.fromkeys([metrics_url(args.endpoint), *args.metrics_url, *nodes]))


def _up_state_urls(path: Path) -> list[str]:
    """The prefill and decode nodes' metrics URLs in ``tierserve up``'s state file."""
    try:
        children = json.loads(path.read_text())["children"]
        return [c["metrics_url"] for c in children if c["role"] in ("prefill", "decode") and c["metrics_url"]]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a `tierserve up --state-file` file: {exc!r}") from None


def cmd_bench_run(args: argparse.Namespace) -> int:
    from tierserve.bench.plots import save_plots
    from tierserve.bench.runner import run_bench

    try:
        workload, options = build_workload(args), bench_options(args)
    except (ValueError, OSError) as exc:
        print(f"tierserve bench: {exc}", file=sys.stderr)
        return 2
    from tierserve.bench.server_metrics import ScrapeError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the bar
    try:
        report = run_bench(args.endpoint, workload, options)
    except ScrapeError as exc:  # before the run: a wrong URL is a usage error
        print(f"tierserve bench: --scrape-metrics: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report.to_json(args.out)
        print(f"report: {args.out}")
    if args.plots_dir:
        stem = args.out.stem if args.out else args.workload
        for path in save_plots(report, args.plots_dir, stem, label=args.workload):
            print(f"plot: {path}")
    return 0 if report.ok else 1


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from tierserve.bench.compare import compare
    from tierserve.bench.report import Report

    try:
        a, b = Report.from_json(args.a), Report.from_json(args.b)
    except (OSError, ValueError, KeyError) as exc:
        print(f"tierserve bench compare: cannot read a report: {exc}", file=sys.stderr)
        return 2
    print(compare(a, b, (args.a.stem, args.b.stem)))
    if args.plots_dir:
        from tierserve.bench.plots import plot_hit_rate, plot_ttft_cdf

        args.plots_dir.mkdir(parents=True, exist_ok=True)
        reports = {args.a.stem: a, args.b.stem: b}
        for path in (plot_ttft_cdf(reports, args.plots_dir / "compare_ttft_cdf.png"),
                     plot_hit_rate(reports, args.plots_dir / "compare_hit_rate.png")):
            print(f"plot: {path}")
    return 0
