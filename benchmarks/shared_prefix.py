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
``--repeats`` rounds and the after/before ratio of the medians. Both servers run throughout, or with
``--one-at-a-time`` each is started for its round and stopped after it (a warm-up request each time; the
output check on a source's first round): half the memory, for a machine that cannot hold two clusters.

    .venv/bin/python benchmarks/shared_prefix.py [--mode serve|up] [--before-src DIR] [--prefix 512]
        [--concurrency 8] [--repeats 3] [--one-at-a-time]
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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
Rows = dict[str, list[dict[str, float]]]  # per source name, one row per round
Source = tuple[str, Path]  # its name and its tierserve src folder


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


async def run(servers: list[Server | Cluster], work: Workload, rows: Rows, equal: dict[str, bool]) -> None:
    """Every server running at once: warm-ups, the output check, then the rounds, alternating the order."""
    async with httpx.AsyncClient(timeout=600) as client:
        for s in servers:  # warm-up (first-request costs), outside the timing
            await shared(client, s.url, work.shared()[:2], 2)
        equal |= {s.name: await equal_outputs(client, s.url, work) for s in servers}
        for r in range(work.args.repeats):
            for s in rotated(servers, r):
                record(rows, s.name, await one_round(client, s.url, work))


async def visit(server: Server | Cluster, work: Workload, rows: Rows, equal: dict[str, bool]) -> None:
    """One round on a server just started: its warm-up, the output check on its source's first visit."""
    async with httpx.AsyncClient(timeout=600) as client:
        await shared(client, server.url, work.shared()[:2], 2)
        if server.name not in equal:
            equal[server.name] = await equal_outputs(client, server.url, work)
        record(rows, server.name, await one_round(client, server.url, work))


def record(rows: Rows, name: str, row: dict[str, float]) -> None:
    """Keeps a round's row and prints it at once (a run cut short still shows its rounds)."""
    rows[name].append(row)
    print(f"round {len(rows[name])} {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)


def rotated(items: list, r: int) -> list:
    """Round ``r``'s order: the list rotated by ``r``, so each goes first in turn."""
    return items[r % len(items):] + items[: r % len(items)]


@contextmanager
def started(args: argparse.Namespace, source: Source, logs: Path) -> Iterator[Server | Cluster]:
    """The source's server for the block (not yet ready), stopped after it."""
    server = start(args.mode, *source, logs, args.flags.split())
    try:
        yield server
    finally:
        stop(server.proc)


def all_at_once(sources: list[Source], logs: Path, work: Workload, rows: Rows, equal: dict[str, bool]) -> None:
    with ExitStack() as stack:
        servers = [stack.enter_context(started(work.args, s, logs)) for s in sources]
        for s in servers:
            s.wait_ready()
        asyncio.run(run(servers, work, rows, equal))


def one_at_a_time(sources: list[Source], logs: Path, work: Workload, rows: Rows, equal: dict[str, bool]) -> None:
    """A fresh server per source and round, alone on the machine (half the memory of ``all_at_once``)."""
    for r in range(work.args.repeats):
        for source in rotated(sources, r):
            with started(work.args, source, logs) as server:
                server.wait_ready()
                asyncio.run(visit(server, work, rows, equal))


def report(rows: Rows, equal: dict[str, bool], args: argparse.Namespace) -> None:
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
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start each server for its round and stop it after, instead of all running throughout")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="shared-prefix-"))
    sources = [("after", ROOT / "src")] + ([("before", args.before_src)] if args.before_src is not None else [])
    rows: Rows = {name: [] for name, _ in sources}
    equal: dict[str, bool] = {}
    (one_at_a_time if args.one_at_a_time else all_at_once)(sources, logs, Workload(args), rows, equal)
    report(rows, equal, args)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
