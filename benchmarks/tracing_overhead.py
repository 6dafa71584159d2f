"""What OpenTelemetry tracing costs a cluster's throughput (docs/tracing.md, issue 34).

Starts two ``tierserve up`` clusters on the built-in model (CPU, no L3, every prompt through the
PD path): one without tracing, one with ``--otlp-traces-endpoint`` at ``--otlp-traces-sample-ratio
1.0`` sending to an OTLP receiver in this process (``tests/helpers/otlp_receiver.py``: it decodes and
keeps every span, as a collector would); every process computes with one OpenMP thread. Per round,
the same load runs on each, the order alternating from round to round: ``--clients`` closed-loop
clients send ``--requests`` completions in all, each a fresh ``--prompt-tokens``-token prompt (token
ids: no cache hit) with ``--max-tokens`` greedy output tokens (``ignore_eos``). Reported: requests/s
and output tokens/s per round and cluster, the medians, and the median of the per-round ratios
(on / off), with the spans received per request; and the CPU seconds the cluster's processes
(router, nodes, ``up``) spent per request (``/proc``: user + system), which the machine's other load
disturbs less than wall-clock throughput (the receiver's own CPU, in this process, is not in it).

``--direct``: no cluster; the CPU time of making one PD request's spans (the router's, the prefill
node's and the decode node's: 19 spans, the three ``traceparent`` hops) with the real SDK exporting
to the receiver, per request, over ``--requests`` requests: the cost itself, apart from the noise.

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 5] [--clients 4] [--requests 64]
    .venv/bin/python benchmarks/tracing_overhead.py --direct --requests 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' process helpers and OTLP receiver, reused
from helpers.otlp_receiver import otlp_receiver  # noqa: E402
from helpers.processes import free_port, start_up  # noqa: E402

CLUSTER = ["--no-l3", "--max-total-tokens", "16384", "--quiet-access-log", "--log-level", "warning"]
# One OpenMP thread per process, as in the tests: on a shared machine torch's threads spin waiting for each
# other, which buries a small difference under CPU time nobody asked for.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
VOCAB = 49152  # the built-in model's
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and every process under it (so far, the living ones)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


async def load(url: str, rng: random.Random, args: argparse.Namespace) -> tuple[float, float]:
    """``args.requests`` completions from ``args.clients`` clients at once: (requests/s, output tokens/s)."""
    prompts = [[rng.randrange(100, VOCAB) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            body = {"prompt": queue.get_nowait(), "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            reply = await http.post(f"{url}/v1/completions", json=body)
            reply.raise_for_status()
            tokens += reply.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.clients)))
        elapsed = time.perf_counter() - started
    return args.requests / elapsed, tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=64, help="per round and cluster")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, help="write the rounds and medians as JSON here")
    p.add_argument("--direct", action="store_true", help="time one request's spans in this process instead")
    args = p.parse_args()
    if args.direct:
        direct(args.requests)
        return
    with otlp_receiver() as receiver:
        ports = {"off": free_port(), "on": free_port()}
        tracing = ["--otlp-traces-endpoint", receiver.endpoint, "--otlp-traces-sample-ratio", "1.0"]
        procs = [start_up(ports["off"], *CLUSTER, env=ONE_THREAD)[0],
                 start_up(ports["on"], *CLUSTER, *tracing, env=ONE_THREAD)[0]]
        try:
            rounds = run(args, ports, {"off": procs[0].pid, "on": procs[1].pid})
            time.sleep(6)  # the exporter's last batch (every 5 s by default)
            traced = args.rounds * args.requests + args.clients * 2
            spans = len(receiver.spans()) / traced
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGINT)
            for proc in procs:
                proc.wait(timeout=120)
    report(args, rounds, spans)


def run(args: argparse.Namespace, ports: dict[str, int], pids: dict[str, int]) -> list[dict[str, float]]:
    rounds = []
    warm = argparse.Namespace(**{**vars(args), "requests": args.clients * 2})
    for name in ("off", "on"):  # each cluster's first requests (allocations, code paths) outside the rounds
        asyncio.run(load(f"http://127.0.0.1:{ports[name]}", random.Random(-1), warm))
    for i in range(args.rounds):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        row: dict[str, float] = {}
        for name in order:
            cpu = cpu_seconds(pids[name])
            rps, tps = asyncio.run(load(f"http://127.0.0.1:{ports[name]}", random.Random(i), args))
            row[f"{name}_rps"], row[f"{name}_tps"] = rps, tps
            row[f"{name}_cpu_ms"] = (cpu_seconds(pids[name]) - cpu) / args.requests * 1000
        row["ratio"], row["cpu_ratio"] = row["on_rps"] / row["off_rps"], row["on_cpu_ms"] / row["off_cpu_ms"]
        print(f"round {i + 1} ({order[0]} first): off {row['off_rps']:.2f} req/s {row['off_tps']:.1f} tok/s "
              f"{row['off_cpu_ms']:.0f} CPU ms/req; on {row['on_rps']:.2f} req/s {row['on_tps']:.1f} tok/s "
              f"{row['on_cpu_ms']:.0f} CPU ms/req; on/off {row['ratio']:.3f} (CPU {row['cpu_ratio']:.3f})", flush=True)
        rounds.append(row)
    return rounds


def one_request(router: object, prefill: object, decode: object) -> None:
    """The spans one PD request makes in the three processes, as the code makes them."""
    from tierserve.tracing import SpanKind

    now = time.monotonic()
    http = router.server("POST /v1/completions", {}, {"tierserve.request_id": "r"})  # type: ignore[attr-defined]
    with http, http.child("tierserve.choice", attrs={"tierserve.request_id": "r-0"}) as choice:
        choice.child("tierserve.admission").end()
        with choice.child("tierserve.attempt") as attempt:
            attempt.record("tierserve.route", now, now, {"tierserve.path": "prefill_decode"})
            for name, node in (("Reserve", decode), ("Prefill", prefill), ("Generate", decode)):
                with attempt.child(name, SpanKind.CLIENT) as call, node.server(name, call.headers()) as served:
                    if name == "Prefill":
                        queue = served.record("tierserve.queue", now, now)
                        queue.record("tierserve.l3_prefetch_wait", now, now)
                        for part in ("tierserve.prefix_match", "tierserve.prefill_compute", "tierserve.kv_handoff"):
                            served.record(part, now, now, {"tierserve.cached_tokens.device": 16})
                    elif name == "Generate":
                        for part in ("tierserve.decode_queue", "tierserve.first_token", "tierserve.decode"):
                            served.record(part, now, now)
            attempt.set({"tierserve.cached_tokens": 16})


def direct(requests: int) -> None:
    from tierserve.tracing import TracingConfig, start_tracing

    with otlp_receiver() as receiver:
        config = TracingConfig(receiver.endpoint)
        tracers = [start_tracing(config, service) for service in ("router", "prefill", "decode")]
        for _ in range(200):  # warm
            one_request(*tracers)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(requests):
            one_request(*tracers)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        time.sleep(6)  # the exporter's last batch
        spans = len(receiver.spans()) / (requests + 200)
    print(f"{requests} requests' spans: {cpu / requests * 1e6:.0f} us CPU per request ({wall / requests * 1e6:.0f} us "
          f"wall; this process's CPU, the exporter threads' and the receiver's included); {spans:.1f} spans each")


def report(args: argparse.Namespace, rounds: list[dict[str, float]], spans: float) -> None:
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"\nmedians over {len(rounds)} rounds: off {med['off_rps']:.2f} req/s ({med['off_tps']:.1f} tok/s), "
          f"on {med['on_rps']:.2f} req/s ({med['on_tps']:.1f} tok/s); ratio of medians "
          f"{med['on_rps'] / med['off_rps']:.3f}; median per-round ratio {med['ratio']:.3f}; "
          f"CPU per request off {med['off_cpu_ms']:.0f} ms, on {med['on_cpu_ms']:.0f} ms, median per-round ratio "
          f"{med['cpu_ratio']:.3f}; spans received per traced request {spans:.1f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                        "medians": med, "spans_per_request": spans}, indent=2))


if __name__ == "__main__":
    main()
