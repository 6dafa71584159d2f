"""A follow-up on the other prefill node while the first node's L3 backup is in flight (docs/cache.md,
backups in flight), through `tierserve up` (two prefill nodes, round robin, always PD).

Starts `tierserve up` from this checkout and, with ``--before-src DIR``, a second one from another copy of
the source (e.g. the commit before the router's pending-pages count: ``git archive <commit> src | tar -x -C
DIR``). Each round sends a fresh random prompt of each ``--lengths`` twice, the second right after the
first answered (no pause): round robin sends it to the node that never saw it. Reported per length and
source, medians over ``--repeats`` rounds (alternating which cluster goes first): the share of the second
request's prompt served from L3, and its time over the first's (both end to end, ``--max-tokens`` tokens).

``--write-delay S`` slows every L3 write call of the nodes by S seconds (the tests' fault channel,
``tests/helpers/injected_faults.py``): a store slower than this machine's local one (a remote store over
TCP, or a backup of a 100K-token prompt of a large model), so that the follow-up finds the backup in
flight. Both sources must read that fault (the commit that added the count does: compare against a copy of
it with ``_pending_in_l3`` returning 0).

``--model long`` is the tests' tiny long-context Llama (``tests/helpers/long_prompts.py``: 512 B of KV per
token, so 32K tokens are 16 MiB to back up), ``--model builtin`` the built-in SmolLM2-135M (its KV is 46 KiB
per token in float32: a 2K prompt is 92 MiB).

    .venv/bin/python benchmarks/followup_l3.py [--before-src DIR] [--model builtin|long] [--lengths 2048]
        [--prefill-cp-size 1] [--write-delay 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model and process helpers, reused
from helpers.injected_faults import node_env, write_faults  # noqa: E402
from helpers.long_prompts import long_model  # noqa: E402
from helpers.processes import ALWAYS_PD, stop  # noqa: E402

from tierserve.launch import free_port  # noqa: E402

UP_DEADLINE_S = 600.0
VOCAB = {"builtin": 49152, "long": 384}


class Cluster:
    """`tierserve up` (always PD) importing tierserve from ``src``, with ``flags`` on top; ready once it printed
    its banner. Also started by ``shared_prefix.py --mode up``."""

    def __init__(self, name: str, src: Path, logs: Path, flags: list[str], env: dict[str, str]) -> None:
        self.name, self.port = name, free_port()
        env = os.environ | env | {"PYTHONPATH": str(src)}
        cmd = [sys.executable, "-m", "tierserve.cli", "up", "--port", str(self.port), "--device", "cpu",
               "--quiet-access-log", *ALWAYS_PD, *flags]
        self.log = logs / f"{name}.log"
        self._up = threading.Event()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.log.open("a") as out:
            for line in self.proc.stdout:
                out.write(line)
                if line.startswith("tierserve is up"):
                    self._up.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + UP_DEADLINE_S
        while not self._up.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not come up: see {self.log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """Seconds end to end and the prompt tokens served from L3."""
    start = time.perf_counter()
    reply = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True})
    reply.raise_for_status()
    return time.perf_counter() - start, reply.json()["usage"]["cached_tokens_by_tier"]["storage"]


def one_round(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    first_s, _ = complete(client, url, prompt, max_tokens)
    second_s, from_l3 = complete(client, url, prompt, max_tokens)
    return {"l3_share": from_l3 / len(prompt), "second_over_first": second_s / first_s, "first_s": first_s}


def run(clusters: list[Cluster], args: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, float]]]:
    rng = random.Random(0)
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    with httpx.Client(timeout=1800) as client:
        for c in clusters:  # warm-up (first-request costs), outside the timing
            complete(client, c.url, [rng.randrange(2, VOCAB[args.model]) for _ in range(64)], 2)
        for r in range(args.repeats):
            for length in args.lengths:
                for c in clusters[r % len(clusters):] + clusters[: r % len(clusters)]:
                    prompt = [rng.randrange(2, VOCAB[args.model]) for _ in range(length)]
                    rows.setdefault((c.name, length), []).append(one_round(client, c.url, prompt, args.max_tokens))
    return rows


def report(rows: dict[tuple[str, int], list[dict[str, float]]], args: argparse.Namespace) -> None:
    print(f"model={args.model}, CPU, prefill CP={args.prefill_cp_size}, max_tokens={args.max_tokens}, "
          f"L3 write delay={args.write_delay} s, repeats={args.repeats} (medians)")
    print("| source | prompt tokens | second request: share from L3 | second / first time | first (s) |")
    print("|---|---:|---:|---:|---:|")
    for (name, length), runs in rows.items():
        m = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(f"| {name} | {length} | {m['l3_share']:.3f} | {m['second_over_first']:.3f} | {m['first_s']:.2f} |")


def flags(args: argparse.Namespace, models: Path) -> list[str]:
    own = ["--prefill-nodes", "2", "--prefill-policy", "round_robin", "--prefill-cp-size", str(args.prefill_cp_size),
           "--max-total-tokens", str(args.max_total_tokens)]
    if args.model == "long":
        own += ["--model", str(long_model(models / "long")), "--dtype", "float32", "--chunked-prefill-size", "4096"]
    return own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-src", type=Path, help="a tierserve src folder to compare against")
    ap.add_argument("--model", choices=sorted(VOCAB), default="builtin")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--prefill-cp-size", type=int, default=1)
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="per node: 40960 for 32K prompts")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--write-delay", type=float, default=0.0, help="seconds added to every L3 write call")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="followup-l3-"))
    own = flags(args, logs)
    slow = {"ranks": list(range(args.prefill_cp_size)), "set_delay_s": args.write_delay}
    env = node_env(write_faults(logs / "faults.json", slow)) if args.write_delay else {}
    clusters = [Cluster("after", ROOT / "src", logs, own, env)]
    if args.before_src is not None:
        clusters.append(Cluster("before", args.before_src, logs, own, env))
    try:
        for c in clusters:
            c.wait_ready()
        report(run(clusters, args), args)
    finally:
        for c in clusters:
            stop(c.proc)
    print(f"logs: {logs}")


if __name__ == "__main__":
    main()
