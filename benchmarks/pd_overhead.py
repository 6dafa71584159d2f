"""What the prefill/decode path costs over a single engine, for tiny requests.

Starts, on a tiny random llama (CPU, float32), a single engine (``tierserve serve``) and a cluster
of the same processes the tests start (``tierserve prefill``, ``tierserve decode`` and
``tierserve router`` over them, no L3; with ``--up``: ``tierserve up``, with L3, HiCache and KV
events; ``--threshold``: the router's ``--disaggregation-threshold``, default 0: the PD path for every
prompt, a one-token request on the prefill node alone), then sends both the same tiny requests to
``/v1/completions``: a 16-token prompt (token ids, a fresh one each time, so no cache hit) with
``--output-tokens`` output tokens (greedy, ``ignore_eos``), non-streaming, over keep-alive
connections. Per repetition and target: ``--requests`` requests one at a time (latency p50, p99,
requests/s), then with 16 in flight (each slot sends ``--requests`` / 16, at least 20). Targets alternate
which goes first in each repetition; reported are the medians over repetitions and the median
of the per-repetition differences (cluster - single p50) and ratios (requests/s).

    .venv/bin/python benchmarks/pd_overhead.py [--repeats 5] [--requests 100] [--output-tokens 1 4] [--up]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' process helpers and tiny models, reused
from helpers.processes import NodeProcess, RouterProcess, ServeProcess, free_port, start_up, stop  # noqa: E402
from helpers.tiny_models import make_tiny_model  # noqa: E402

ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]
PROMPT_TOKENS = 16
TARGETS = ("single", "cluster")


class Prompts:
    """Fresh 16-token prompts: no request hits another's cache (the vocabulary is 384 tokens)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def next(self) -> list[int]:
        return [self.rng.randrange(2, 384) for _ in range(PROMPT_TOKENS)]


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], output_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    reply = await client.post(f"{url}/v1/completions", json=body)
    reply.raise_for_status()
    assert reply.json()["usage"]["completion_tokens"] == output_tokens
    return time.perf_counter() - start


async def load(url: str, prompts: Prompts, requests: int, concurrency: int, output_tokens: int
               ) -> dict[str, float]:
    """``requests`` per slot, ``concurrency`` slots in flight: p50, p99 (ms), requests/s."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        await one(client, url, prompts.next(), output_tokens)  # opens a connection outside the timing

        async def worker() -> list[float]:
            return [await one(client, url, prompts.next(), output_tokens) for _ in range(requests)]

        start = time.perf_counter()
        parts = await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    latencies = sorted(x for part in parts for x in part)
    return {"p50": 1000 * statistics.median(latencies),
            "p99": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "rps": len(latencies) / wall}


class _Up:
    """``tierserve up`` (L3 master, nodes with HiCache, Mooncake and KV events, router)."""

    def __init__(self, model: Path, threshold: int, log_level: str) -> None:
        self.port = free_port()
        flags = [*(f for f in ENGINE if f not in ("--device", "cpu")), "--log-level", log_level]  # start_up: cpu
        self.proc, _ = start_up(self.port, "--model", str(model), "--l3-size-gb", "1", *flags,
                                "--disaggregation-threshold", str(threshold))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.proc)


def start(model: Path, logs: Path, use_up: bool, threshold: int, log_level: str = "warning"
          ) -> tuple[dict[str, str], list]:
    """The single engine and the cluster, ready; their URLs and processes."""
    serve = ServeProcess(["--model", str(model), *ENGINE, "--log-level", log_level], logs / "serve.log")
    if use_up:
        procs: list = [serve, _Up(model, threshold, log_level)]
        serve.wait_ready()
        return {"single": serve.url, "cluster": procs[1].url}, procs
    node = ["--model", str(model), *ENGINE, "--log-level", log_level]
    prefill = NodeProcess("prefill", node, logs / "prefill.log")
    decode = NodeProcess("decode", node, logs / "decode.log")
    procs: list = [serve, prefill, decode]
    serve.wait_ready()
    prefill.wait_ready()
    decode.wait_ready()
    router = RouterProcess(["--model", str(model), "--prefill", prefill.address, "--decode", decode.address,
                            "--log-level", log_level, "--disaggregation-threshold", str(threshold)],
                           logs / "router.log")
    procs.append(router)
    router.wait_ready()
    return {"single": serve.url, "cluster": router.url}, procs


def summary(runs: dict[str, list[dict[str, float]]]) -> str:
    lines = []
    for target in TARGETS:
        med = {k: statistics.median(r[k] for r in runs[target]) for k in ("p50", "p99", "rps")}
        lines.append(f"    {target:8s} p50 {med['p50']:6.2f} ms  p99 {med['p99']:6.2f} ms  {med['rps']:6.1f} req/s")
    extra = [c["p50"] - s["p50"] for s, c in zip(runs["single"], runs["cluster"], strict=True)]
    ratio = [c["rps"] / s["rps"] for s, c in zip(runs["single"], runs["cluster"], strict=True)]
    lines.append(f"    cluster adds {statistics.median(extra):.2f} ms p50 (median of differences); "
                 f"requests/s cluster/single {statistics.median(ratio):.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100, help="per run (spread over the in-flight slots)")
    parser.add_argument("--output-tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threshold", type=int, default=0,
                        help="the router's --disaggregation-threshold (0: every prompt through the prefill node)")
    parser.add_argument("--log-level", default="warning", help="of every process (serve's access log is off)")
    parser.add_argument("--up", action="store_true",
                        help="the cluster is `tierserve up` (with L3 and KV events), not bare nodes + router")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="pd_overhead-"))
    model = make_tiny_model("llama", logs / "model")
    urls, procs = start(model, logs, args.up, args.threshold, args.log_level)
    prompts = Prompts(0)
    cases = [(o, c) for o in args.output_tokens for c in args.concurrency]
    runs = {case: {t: [] for t in TARGETS} for case in cases}
    try:
        for target in TARGETS:  # warm-up: both sides ran the model and opened their channels
            asyncio.run(load(urls[target], prompts, 20, 4, 2))
        for rep in range(args.repeats):
            for case in cases:
                order = TARGETS if rep % 2 == 0 else TARGETS[::-1]
                for target in order:
                    per_slot = max(args.requests // case[1], 20)
                    r = asyncio.run(load(urls[target], prompts, per_slot, case[1], case[0]))
                    runs[case][target].append(r)
                    print(f"rep {rep} output {case[0]} concurrency {case[1]:2d} {target:8s}: p50 {r['p50']:6.2f} ms "
                          f"p99 {r['p99']:6.2f} ms {r['rps']:6.1f} req/s", flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()
    print(f"\n{PROMPT_TOKENS}-token prompts, tiny llama on CPU, medians of {args.repeats} repetitions (logs {logs}):")
    for case in cases:
        print(f"  output {case[0]} token(s), {case[1]} concurrent:\n{summary(runs[case])}")


if __name__ == "__main__":
    main()
