"""A shared prefix computed once (docs/cache.md, in-flight sharing), through the API of `tierserve serve`
(``--mode serve``) or of `tierserve up` (``--mode up``: one prefill and one decode node, always PD, as the tests
run it; the cluster is ``followup_l3.py``'s).

Starts the server on the built-in model (CPU) from this checkout and, with ``--before-src DIR``, a second one
from another copy of the source (e.g. the commit before in-flight sharing:
``git archive <commit> src | tar -x -C DIR``), and sends both, alternating which goes first each round:

- ``shared``: ``--concurrency`` requests at once sharing a ``--prefix``-token prefix, each with its own
  ``--question``-token tail (token ids, greedy, ``--max-tokens``); wall time and the cached prompt tokens
  reported against the ideal (every request but one hits the prefix's full pages);
- ``n``: one request of ``--n`` choices against one of 1 choice (fresh prompts of the same length), and
  the same n-choice request again once its prompt is cached (its time is mostly the n decodes):
  ``n / (1 + decode)`` is the n-choice time over the 1-choice time plus that;
- once, ``equal``: whether the shared requests' greedy outputs equal the same requests sent one by one
  (each with its own ``cache_salt``, so none reuses another's KV).

Every round uses fresh random prefixes (nothing cached from an earlier round). Reported: medians over
``--repeats`` rounds and the after/before ratio of the medians.

    .venv/bin/python benchmarks/shared_prefix.py [--mode serve|up] [--before-src DIR] [--prefix 512]
        [--concurrency 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path

import httpx
from followup_l3 import Cluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' polling and process helpers, reused
from helpers.polling import wait_until  # noqa: E402
from helpers.processes import stop  # noqa: E402

from tierserve.launch import free_port, http_ok  # noqa: E402

PAGE = 16  # serve's and up's default --page-size
VOCAB = 49152  # the built-in model's


class Mode(Enum):
    """Which command serves the API."""

    SERVE = "serve"
    UP = "up"


class Server:
    """`tierserve serve` on the built-in model, importing tierserve from ``src``."""

    def __init__(self, name: str, src: Path, logs: Path, flags: list[str]) -> None:
        self.name, self.port = name, free_port()
        env = os.environ | {"PYTHONPATH": str(src)}
        cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--port", str(self.port), "--quiet-access-log",
               "--device", "cpu", *flags]
        with open(logs / f"{name}.log", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.log = logs / f"{name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_until(lambda: http_ok(self.url + "/health"), self.name, 300.0, self.proc, self.log)


def start(mode: Mode, name: str, src: Path, logs: Path, flags: list[str]) -> Server | Cluster:
    """A ``mode`` server importing tierserve from ``src``, starting (``wait_ready`` waits for it)."""
    if mode is Mode.UP:
        return Cluster(name, src, logs, flags, {})
    return Server(name, src, logs, flags)


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, n: int = 1,
                   salt: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "n": n}
    if salt is not None:
        body["cache_salt"] = salt
    reply = await client.post(f"{url}/v1/completions", json=body)
    reply.raise_for_status()
    return reply.json()


def cached(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def shared(client: httpx.AsyncClient, url: str, prompts: list[list[int]], max_tokens: int
                 ) -> tuple[float, int, list[str]]:
    """Seconds for all of ``prompts`` sent at once, their cached tokens, their texts."""
    start = time.perf_counter()
    bodies = await asyncio.gather(*(complete(client, url, p, max_tokens) for p in prompts))
    return time.perf_counter() - start, sum(map(cached, bodies)), [b["choices"][0]["text"] for b in bodies]


async def timed(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, n: int) -> float:
    start = time.perf_counter()
    await complete(client, url, prompt, max_tokens, n)
    return time.perf_counter() - start


class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rng = args, random.Random(0)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(2, VOCAB) for _ in range(n)]

    def shared(self) -> list[list[int]]:
        prefix = self.tokens(self.args.prefix)
        return [prefix + self.tokens(self.args.question) for _ in range(self.args.concurrency)]


async def one_round(client: httpx.AsyncClient, url: str, work: Workload) -> dict[str, float]:
    args = work.args
    seconds, hits, _ = await shared(client, url, work.shared(), args.max_tokens)
    length = args.prefix + args.question
    one = await timed(client, url, work.tokens(length), args.max_tokens, 1)
    prompt = work.tokens(length)
    many = await timed(client, url, prompt, args.max_tokens, args.n)
    decode = await timed(client, url, prompt, args.max_tokens, args.n)  # prompt cached: mostly the n decodes
    ideal = (args.concurrency - 1) * (args.prefix // PAGE * PAGE)
    return {"shared_s": seconds, "cached_share": hits / ideal, "n1_s": one, "n_s": many,
            "n_over_1_plus_decode": many / (one + decode)}


async def equal_outputs(client: httpx.AsyncClient, url: str, work: Workload) -> bool:
    prompts = work.shared()
    _, _, together = await shared(client, url, prompts, work.args.max_tokens)
    alone = [(await complete(client, url, p, work.args.max_tokens, salt=f"alone-{i}"))["choices"][0]["text"]
             for i, p in enumerate(prompts)]
    return together == alone


async def run(servers: list[Server | Cluster], args: argparse.Namespace) -> None:
    work = Workload(args)
    rows: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
    async with httpx.AsyncClient(timeout=600) as client:
        for s in servers:  # warm-up (first-request costs), outside the timing
            await shared(client, s.url, work.shared()[:2], 2)
        equal = {s.name: await equal_outputs(client, s.url, work) for s in servers}
        for r in range(args.repeats):
            for s in servers[r % len(servers):] + servers[: r % len(servers)]:
                rows[s.name].append(await one_round(client, s.url, work))
    report(rows, equal, args)


def report(rows: dict[str, list[dict[str, float]]], equal: dict[str, bool], args: argparse.Namespace) -> None:
    print(f"tierserve {args.mode.value}, built-in model, CPU, prefix={args.prefix} question={args.question} "
          f"concurrency={args.concurrency} n={args.n} max_tokens={args.max_tokens} repeats={args.repeats} (medians)")
    keys = ["shared_s", "cached_share", "n1_s", "n_s", "n_over_1_plus_decode"]
    print("| server | " + " | ".join(keys) + " | outputs equal one-by-one |")
    print("|---|" + "---:|" * len(keys) + "---|")
    med = {name: {k: statistics.median(x[k] for x in runs) for k in keys} for name, runs in rows.items()}
    for name, m in med.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in keys) + f" | {equal[name]} |")
    if "before" in med:
        print(f"after/before: shared {med['after']['shared_s'] / med['before']['shared_s']:.3f}, "
              f"n={args.n} {med['after']['n_s'] / med['before']['n_s']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", type=Mode, choices=list(Mode), default=Mode.SERVE, metavar="{serve,up}",
                    help="serve: one engine; up: a cluster (1 prefill, 1 decode, always PD)")
    ap.add_argument("--before-src", type=Path, help="a tierserve src folder to compare against")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--question", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flags", default="", help="more serve (resp. up) flags for both servers")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="shared-prefix-"))
    servers = [start(args.mode, "after", ROOT / "src", logs, args.flags.split())]
    if args.before_src is not None:
        servers.append(start(args.mode, "before", args.before_src, logs, args.flags.split()))
    try:
        for s in servers:
            s.wait_ready()
        asyncio.run(run(servers, args))
    finally:
        for s in servers:
            stop(s.proc)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
